"""What a program the judge reads (:mod:`course.hand`) may use: lists, not a search for what to refuse.

Each name here was put on the list because answers by hand (an LSTM from matrix products and
pointwise ops, attention from a softmax) are written with it, and because it computes on tensors and
nothing else: no callable it runs, no global state it sets, no memory it reaches unchecked (sparse
tensors, whose invariants PyTorch does not check by default, and pointers are not here). A name a
release does not have is simply not there. What is not listed is refused, with a message that names it.

An exercise reads its answers with a :class:`Vocabulary`, the part of these lists it needs: lesson 10's
workers (``WORKERS``: messages between ranks, DDP, an optimizer, a hook's bucket and future) and every
other answer (``TENSORS``), which reaches none of the workers' modules or methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

_POINTWISE = """
abs absolute add sub subtract mul multiply div divide true_divide floor_divide remainder fmod neg negative reciprocal
pow float_power sqrt rsqrt square exp exp2 expm1 log log2 log10 log1p sigmoid tanh sin cos tan asin acos atan atan2
arcsin arccos arctan arctan2 sinh cosh asinh acosh atanh erf erfc erfinv sign sgn clamp clip clamp_min clamp_max
maximum minimum fmax fmin floor ceil round trunc frac lerp addcmul addcdiv hypot logaddexp logaddexp2 xlogy nan_to_num
relu logit eq ne lt le gt ge greater greater_equal less less_equal not_equal logical_and logical_or logical_not
logical_xor bitwise_and bitwise_or bitwise_not bitwise_xor masked_fill fill zero
""".split()

_OTHER = """
softmax log_softmax where equal isclose allclose isnan isinf isfinite isneginf isposinf
sum nansum mean nanmean prod max min amax amin aminmax argmax argmin std var std_mean var_mean norm logsumexp cumsum
cumprod cummax cummin logcumsumexp all any count_nonzero median sort argsort topk kthvalue
mm bmm matmul mv dot vdot outer ger addmm addbmm baddbmm addmv addr einsum tensordot kron inner cross chain_matmul
trace det inverse
cat concat concatenate stack hstack vstack dstack column_stack split chunk tensor_split unbind reshape flatten unflatten
squeeze unsqueeze transpose swapaxes swapdims permute movedim moveaxis t narrow select index_select masked_select
gather scatter scatter_add scatter_reduce take take_along_dim flip fliplr flipud roll rot90 tile repeat_interleave
broadcast_to broadcast_tensors atleast_1d atleast_2d atleast_3d diag diagonal diag_embed diagflat tril triu
tril_indices triu_indices meshgrid block_diag cartesian_prod nonzero argwhere index_add index_fill index_copy
index_put searchsorted bucketize unique unique_consecutive
tensor as_tensor zeros ones full empty eye arange linspace logspace zeros_like ones_like full_like empty_like rand randn
randint rand_like randn_like randint_like randperm complex polar is_tensor is_floating_point is_complex numel
get_default_dtype result_type promote_types can_cast finfo iinfo is_grad_enabled is_autocast_enabled
""".split()

#: What ``torch.<name>`` a program may read (with the dtypes, ``torch.float32`` and the like, and
#: its float constants, ``torch.inf``); ``torch.vmap`` too, the alias of ``torch.func.vmap`` the lessons
#: name (a red team's false failure, 2026-12-05: a right answer written with it was refused).
TORCH = frozenset(_POINTWISE + _OTHER + ["vmap"])

#: Classes a program may name only as ``isinstance``'s second argument: called, ``torch.Tensor``
#: has a legacy constructor that takes a C++ pointer as an integer (``Tensor(cdata=...)``; red
#: team, 2026-12-01), and its unbound methods need no class.
CLASSES = {"torch": frozenset({"Tensor"})}

#: Context managers a program may name only as the call of a ``with`` statement, without ``as``
#: (``with torch.autocast("cpu", enabled=False):``): they set torch's thread-local modes and put
#: them back on leaving, and the program never holds the object.
CONTEXTS = {"torch": frozenset({"autocast", "no_grad", "enable_grad", "inference_mode"}),
            "torch.autograd.forward_ad": frozenset({"dual_level"})}

#: What each of them may be given, in the order it takes them: constants only, on these lists (a value
#: ``autocast``'s ``__enter__`` refuses halfway would leave autocast on; red team, 2026-12-01).
_FLAG = (True, False)
CONTEXT_ARGUMENTS = {
    "autocast": {"device_type": ("cpu", "cuda"), "dtype": ("torch.bfloat16", "torch.float16", "torch.float32"),
                 "enabled": _FLAG, "cache_enabled": _FLAG},
    "inference_mode": {"mode": _FLAG}, "no_grad": {}, "enable_grad": {}, "dual_level": {}}

#: ``torch.nn.functional.<name>``.
FUNCTIONAL = frozenset("""
linear bilinear relu relu6 elu selu celu gelu silu mish leaky_relu hardtanh hardswish hardsigmoid softplus softsign
tanhshrink sigmoid tanh logsigmoid softmax softmin log_softmax glu normalize layer_norm group_norm batch_norm
instance_norm rms_norm dropout pad one_hot embedding cosine_similarity pairwise_distance mse_loss cross_entropy nll_loss
binary_cross_entropy binary_cross_entropy_with_logits l1_loss smooth_l1_loss huber_loss kl_div conv1d conv2d conv3d
avg_pool1d avg_pool2d max_pool1d max_pool2d adaptive_avg_pool1d adaptive_avg_pool2d interpolate unfold fold
scaled_dot_product_attention
""".split())

#: ``torch.linalg``, ``torch.special`` and ``torch.fft``.
LINALG = frozenset("""
norm vector_norm matrix_norm inv solve det slogdet eigh eigvalsh svd svdvals qr cholesky lstsq pinv matrix_power
matrix_exp cross vecdot multi_dot diagonal
""".split())
SPECIAL = frozenset("""
expit logit erf erfc erfinv xlogy log_softmax softmax logsumexp entr gammaln digamma i0 ndtr ndtri sinc log1p expm1 exp2
round
""".split())
FFT = frozenset("""
fft ifft rfft irfft fft2 ifft2 rfft2 irfft2 fftn ifftn rfftn irfftn fftfreq rfftfreq fftshift ifftshift hfft ihfft
""".split())

#: ``torch.func``'s transforms and ``torch.autograd.forward_ad``'s duals (lesson 4's JVPs and Jacobians
#: by forward and reverse mode): they run the program's own functions, which the reading has read,
#: and the model the judge gives (``functional_call`` sets only tensors, by name, and puts them back).
#: ``grad`` too (lesson 5's HVPs: a gradient of a gradient). Not ``jacfwd``, ``jacrev``, ``hessian``:
#: the one-call versions of the exercises.
FUNC = frozenset("functional_call grad jvp vjp vmap".split())
FORWARD_AD = frozenset("make_dual unpack_dual".split())

#: Lesson 10's workers: ``torch.distributed``'s messages between ranks, its all-reduce (a communication
#: hook's), and who this rank is; ``DistributedDataParallel`` and ``torch.optim.SGD`` to train with;
#: ``contextlib.nullcontext`` (the ``with`` of the micro-batch that synchronises). A program reads no
#: process group, store or backend: it talks through the group the course's worker joined, and what it
#: sends is counted there, out of its reach (:mod:`course.checks.parallel`).
DISTRIBUTED = frozenset("send recv isend irecv all_reduce get_rank get_world_size".split())
PARALLEL = frozenset({"DistributedDataParallel"})
OPTIM = frozenset({"SGD"})
CONTEXTLIB = frozenset({"nullcontext"})
#: A hook may also make its future itself (``torch.futures.Future()``, ``set_result``) after a blocking all-reduce.
FUTURES = frozenset({"Future"})

#: Module by module: what a program may read there. ``math``'s whole public namespace is pure
#: arithmetic on numbers; ``torch.nn`` is only the way to ``torch.nn.functional``.
MEMBERS = {"torch": TORCH, "torch.nn": frozenset({"functional"}), "torch.nn.functional": FUNCTIONAL,
           "torch.linalg": LINALG, "torch.special": SPECIAL, "torch.fft": FFT, "torch.func": FUNC,
           "torch.autograd": frozenset({"forward_ad"}), "torch.autograd.forward_ad": FORWARD_AD,
           "torch.distributed": DISTRIBUTED, "torch.nn.parallel": PARALLEL, "torch.nn.parallel.distributed": PARALLEL,
           "torch.optim": OPTIM, "contextlib": CONTEXTLIB, "torch.futures": FUTURES}
SUBMODULES = {"torch": frozenset({"nn", "linalg", "special", "fft", "func", "autograd", "distributed", "optim",
                                   "futures"}),
              "torch.nn": frozenset({"functional", "parallel"}),
              "torch.autograd": frozenset({"forward_ad", "functional"})}

#: Attribute names a program may read on a value: tensors' methods of the functions above, their
#: in-place forms, what describes a tensor (shape, dtype, device...) and converts it, what describes
#: a dtype, a device or ``finfo``, and the everyday methods of lists, tuples, dicts and strings.
#: What describes a layer or model the judge gives an answer (lesson 9's ``nn.TransformerEncoderLayer``
#: and its parts, lesson 4's MLP): its submodules, weights and settings, read and called, never changed
#: (no attribute is assigned, and no module method beyond the tensor ones above is listed); a dual's
#: ``primal`` and ``tangent``.
_LAYERS = """
self_attn num_heads head_dim embed_dim batch_first in_proj_weight in_proj_bias out_proj weight bias norm1 norm2
linear1 linear2 norm_first normalized_shape activation
named_parameters parameters primal tangent
""".split()
#: Lesson 10's: a request's ``wait``, a model's training (``backward``, an optimizer's ``zero_grad`` and
#: ``step``, DDP's ``no_sync``), and a communication hook's bucket and future.
_WORKERS = ("wait is_completed backward zero_grad step no_sync buffer gradients is_last get_future then value "
            "set_result done").split()
_IN_PLACE = [f"{n}_" for n in _POINTWISE + "tril triu unsqueeze squeeze t transpose swapaxes swapdims index_fill "
             "index_add index_copy scatter scatter_add scatter_reduce masked_scatter".split()]
_ON_VALUES = frozenset(_POINTWISE + _OTHER + _IN_PLACE + """
shape size dim ndim ndimension nelement dtype device T mT H mH real imag view view_as reshape_as expand expand_as repeat
contiguous is_contiguous clone detach data to cpu cuda float double half bfloat16 int long short bool byte char type_as item
tolist requires_grad requires_grad_ is_leaf grad is_floating_point is_complex masked_scatter copy_ new_zeros new_ones
new_full new_empty new_tensor index_put_ index_add_ index_fill_ index_copy_ scatter_ scatter_add_ scatter_reduce_
clamp_ stride element_size is_cuda is_cpu sum_to_size unfold
is_signed itemsize type index eps tiny bits resolution smallest_normal values indices
append extend insert pop count reverse copy clear remove items keys values get update setdefault join split strip
startswith endswith lower upper replace
""".split() + _LAYERS)
ATTRIBUTES = _ON_VALUES | frozenset(_WORKERS)


@dataclass(frozen=True)
class Vocabulary:
    """What one kind of answer's program may reach: the modules it may import or name (``reach``: their
    members are then read from :data:`MEMBERS`), and the attributes it may read on a value. Each exercise
    reads its answers with the vocabulary it needs (:func:`course.hand.read_program`'s ``vocabulary``),
    never with another lesson's."""
    name: str
    reach: frozenset
    attributes: frozenset
    #: Members of a module that only this vocabulary's programs may read, beside :data:`MEMBERS`'s.
    members: Mapping[str, frozenset] = field(default_factory=dict, hash=False, compare=False)


#: Modules and attributes only lesson 10's workers need: elsewhere there is no process group to talk
#: through, no model to train, no hook's bucket; a program of another lesson that names them is refused.
WORKERS_ONLY = frozenset({"torch.distributed", "torch.nn.parallel", "torch.nn.parallel.distributed", "torch.optim",
                          "contextlib", "torch.futures"})

#: Answers that compute on tensors (lessons 1, 4, 8 and 9): torch's tensor functions, ``math``, a layer's parts.
TENSORS = Vocabulary("tensors", reach=frozenset(MEMBERS) - WORKERS_ONLY | {"math"},
                     attributes=_ON_VALUES)
#: Lesson 4's ``tall_jacobian`` (Exercise 6): the tensor vocabulary and PyTorch's one-call forward-mode
#: Jacobians, which are its answer (``torch.func.jacfwd``; the legacy ``torch.autograd.functional.jacobian``
#: with ``strategy="forward-mode"``). Every other exercise's one-call Jacobian stays off its list.
JACOBIANS = Vocabulary("jacobians", reach=TENSORS.reach | {"torch.autograd.functional"}, attributes=_ON_VALUES,
                       members={"torch.func": frozenset({"jacfwd"}),
                                "torch.autograd.functional": frozenset({"jacobian"})})
#: Lesson 10's answers, run on every rank: the tensor vocabulary, and the workers' own.
WORKERS = Vocabulary("workers", reach=TENSORS.reach | WORKERS_ONLY, attributes=ATTRIBUTES)
VOCABULARIES = {v.name: v for v in (TENSORS, WORKERS, JACOBIANS)}
