"""The lessons' checks, one module per lesson. Visible tests in a notebook call them on the
lesson's own sizes; hidden tests call the same checks on seeds and sizes the learner never saw.
Every check raises ``AssertionError`` with a message written for the learner, and prints one
``ok:`` line when it passes."""
