"""benchmarks/peers/torch_tp.py without torch: its variants run on a stand-in of torch built on numpy
whose NCCL collectives check sizes as NCCL does, so a variant that hands a collective the wrong
tensor fails here, not first on a GPU machine."""
import pathlib
import sys
import types

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _torch_tp():
    sys.path.insert(0, str(REPO / "benchmarks" / "peers"))
    try:
        import torch_tp  # noqa: PLC0415 - benchmarks/ is not a package

        return torch_tp
    finally:
        sys.path.remove(str(REPO / "benchmarks" / "peers"))


class FakeDist:
    """The two collectives the variants call, with NCCL's size checks; rank `rank` of `world`."""

    def __init__(self, rank, world):
        self.rank, self.world, self.calls = rank, world, []

    def all_gather_into_tensor(self, out, inp):
        self.calls.append(("all_gather_into_tensor", out.shape, inp.shape))
        if out.size != inp.size * self.world:
            raise ValueError("all_gather_into_tensor: output tensor size must be equal to world_size times input "
                             "tensor size")
        out.reshape(self.world, -1)[:] = inp.reshape(1, -1)  # every rank's shard: this one's, in this stand-in

    def reduce_scatter_tensor(self, out, inp):
        self.calls.append(("reduce_scatter_tensor", out.shape, inp.shape))
        if inp.size != out.size * self.world:
            raise ValueError("reduce_scatter_tensor: input tensor must be the same size as output size times "
                             "world size")
        out[:] = inp.reshape(self.world, *out.shape)[self.rank] * self.world  # every rank's partials: this one's


def _run_sequential(variants, torch, n, dims):
    """`variants` (torch_tp.variants or fp8_variants) of rank 1 of n on `torch`: every column there,
    the sequential ones run once. Returns (the variants, the stand-in's collectives)."""
    dist = FakeDist(rank=1, world=n)
    peer = types.SimpleNamespace(torch=torch, dist=dist, world=n, rank=1, group="0")
    fns = variants(peer, *dims)
    assert set(fns) == set(_torch_tp().COLUMNS)
    for name in ("gemm_only", "ag_only", "ag_seq", "rs_only", "rs_seq"):
        fns[name]()
    return fns, dist


def fake_torch():
    rng = np.random.default_rng(0)

    class Generator:
        def __init__(self, device):
            pass

        def manual_seed(self, seed):
            return self

    return types.SimpleNamespace(
        bfloat16=np.float32, Generator=Generator,
        randn=lambda *shape, device, dtype, generator: rng.standard_normal(shape).astype(dtype),
        empty=lambda *shape, device, dtype: np.full(shape, np.nan, dtype),
        ops=types.SimpleNamespace(symm_mem=None))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dims", [(64, 32, 64), (64, 48, 32), (1024, 4096, 4096)])
def test_every_sequential_variant_hands_nccl_fitting_tensors(n, dims):
    torch_tp = _torch_tp()
    M, K, N = dims
    fns, dist = _run_sequential(torch_tp.variants, fake_torch(), n, dims)
    assert {call for call, _, _ in dist.calls} == {"all_gather_into_tensor", "reduce_scatter_tensor"}
    shapes = torch_tp.buffer_shapes(M, K, N, n)
    assert fns["ag_seq"]().shape == (M, N // n)
    assert fns["rs_seq"]().shape == shapes["scattered"] == (M // n, K)
    # The collectives alone move what the sequential variants move: the same tensors' shapes.
    rs = [(out, inp) for call, out, inp in dist.calls if call == "reduce_scatter_tensor"]
    assert len(set(rs)) == 1 and rs[0] == ((M // n, K), (M, K))


def test_the_stand_in_refuses_what_nccl_refuses():
    dist = FakeDist(rank=0, world=2)
    with pytest.raises(ValueError, match="input tensor must be the same size as output size times world size"):
        dist.reduce_scatter_tensor(np.empty((32, 48)), np.empty((64, 32)))  # y [M, N/n], M, K, N = 64, 48, 64
    with pytest.raises(ValueError, match="world_size times input"):
        dist.all_gather_into_tensor(np.empty((32, 32)), np.empty((32, 32)))


class FakeArgument:
    def __init__(self, name, type_="Tensor", default=False):
        self.name, self.type, self._default = name, type_, default

    def has_default_value(self):
        return self._default


class FakeOp:
    """A torch op whose schema names `arguments`; calling it returns the keyword arguments it got."""

    def __init__(self, *arguments):
        self.default = types.SimpleNamespace(_schema=types.SimpleNamespace(arguments=list(arguments)))

    def __call__(self, **kwargs):
        return kwargs


def test_fused_fp8_ops_are_called_by_their_schemas_argument_names():
    """torch versions name and order the fused FP8 ops' arguments differently: the peer passes what
    the installed schema names and nothing else, and a required argument it lacks is a clear error."""
    torch_tp = _torch_tp()
    newer = FakeOp(FakeArgument("A"), FakeArgument("B"), FakeArgument("reduce_op", "str"),
                   FakeArgument("orig_scatter_dim", "int"), FakeArgument("output_shape", "Optional[List[int]]"),
                   FakeArgument("out_dtype", "Optional[ScalarType]", default=True))
    got = torch_tp.schema_call(newer, A=1, B=2, reduce_op="sum", orig_scatter_dim=0, scatter_dim=0, out_dtype="bf16")
    assert got == {"A": 1, "B": 2, "reduce_op": "sum", "orig_scatter_dim": 0, "out_dtype": "bf16"}
    older = FakeOp(FakeArgument("A"), FakeArgument("scatter_dim", "int"), FakeArgument("group_name", "str"))
    with pytest.raises(TypeError, match=r"needs \['group_name'\]"):
        torch_tp.schema_call(older, A=1, scatter_dim=0)


class FakeTensor(np.ndarray):
    """What fp8_variants calls on a tensor, on numpy (float32 stands for both bf16 and e4m3)."""

    def to(self, dtype):
        return self.astype(dtype).view(FakeTensor)

    def t(self):
        return self.T

    def contiguous(self):
        return np.ascontiguousarray(self).view(FakeTensor)


def fake_fp8_torch():
    torch = fake_torch()
    randn = torch.randn
    torch.randn = lambda *shape, **kw: randn(*shape, **kw).view(FakeTensor)
    torch.empty = lambda *shape, device, dtype: np.full(shape, np.nan, dtype).view(FakeTensor)
    torch.float8_e4m3fn, torch.float32, torch.uint8 = np.float32, np.float32, np.uint8
    torch.tensor = lambda v, device, dtype: np.asarray(v, dtype)
    torch._scaled_mm = lambda a, b, scale_a, scale_b, out_dtype, use_fast_accum: (a @ b) * scale_a * scale_b
    return torch


@pytest.mark.parametrize("n", [2, 4])
def test_every_sequential_fp8_variant_hands_nccl_fitting_tensors(n):
    """The FP8 variants gather the e4m3 shard (as bytes) and reduce-scatter the bf16 partials, with the
    sizes NCCL checks; the products have the bf16 variants' shapes."""
    M, K, N = 64, 48, 32
    fns, dist = _run_sequential(_torch_tp().fp8_variants, fake_fp8_torch(), n, (M, K, N))
    assert fns["ag_seq"]().shape == (M, N // n) and fns["rs_seq"]().shape == (M // n, K)
    gathers = [(out, inp) for call, out, inp in dist.calls if call == "all_gather_into_tensor"]
    assert gathers[0] == ((M, K * 4), (M // n, K * 4))  # the byte views of the e4m3 stand-in (4 bytes here)
