import torch

from course.models import small_resnet


def test_small_resnet_is_seeded_in_eval_mode_and_classifies():
    a, b = small_resnet(seed=3), small_resnet(seed=3)
    assert not a.training
    x = torch.randn(2, 3, 32, 32)
    assert a(x).shape == (2, 10)
    assert torch.equal(a(x), b(x))
    assert not torch.equal(a(x), small_resnet(seed=4)(x))


def test_batchnorm_statistics_are_not_the_trivial_defaults():
    bns = [m for m in small_resnet(seed=0).modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and all(m.running_var.min() >= 0.5 and m.running_mean.abs().sum() > 0 for m in bns)


def test_tap_gives_one_conv_output_two_users():
    gm = torch.fx.symbolic_trace(small_resnet(seed=0, tap=True))
    modules = dict(gm.named_modules())
    convs = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(modules[n.target], torch.nn.Conv2d)]
    assert any(len(n.users) > 1 for n in convs)
    assert any(len(n.users) == 1 for n in convs)
