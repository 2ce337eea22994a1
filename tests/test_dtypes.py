"""A model whose parameters have two dtypes (the toy with its hidden layer in bf16), which DDP,
ZeroRedundancyOptimizer and FSDP2 (one dtype per unit) all train. 01-05 train it as DDP does, bit
for bit, over the same optimizer (fp32 master weights for the bf16 layer, as in their bf16 runs),
and DDP as one process does (bf16 bounds: zero_parity.bf16_close); 06-08 as FSDP2 does (each unit
kept and stepped in its own dtype); 09, whose one flat buffer has one dtype, refuses it with a
one-line error instead of casting a layer."""
import pytest
import torch
import torch.nn.functional as F

from harness import launches
from lessonkit import optimizers
from lessons import adamw, build
from toy import ToyNet, toy_batch, train_my_rows, train_whole_batch
from zero_parity import bf16_close, identical

STEPS = 4
AS_DDP = ["01", "02", "03", "04", "05"]  # each against DDP
AS_FSDP2 = {"06": "fsdp2", "07": "fsdp2_offload", "08": "fsdp2"}  # each against its FSDP2 run


class MixedToy(ToyNet):
    """ToyNet, its hidden layer in bf16 (its input cast to bf16, its output back to fp32)."""

    def __init__(self):
        super().__init__()
        self.hidden.to(torch.bfloat16)

    def forward(self, x, y):
        h = self.hidden(torch.tanh(self.frozen(self.emb(x))).to(torch.bfloat16)).float()
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def make_mixed():
    torch.manual_seed(0)
    return MixedToy()


def suite(world):
    out = {name: train_my_rows(build(name, make_mixed(), find_unused=name == "ddp"), toy_batch, STEPS, 1)
           for name in [*AS_DDP, "ddp", *AS_FSDP2, *sorted(set(AS_FSDP2.values()))]}
    try:
        build("09", make_mixed())
        out["09"] = None
    except ValueError as e:
        out["09"] = str(e)
    return out


results = launches(suite)


def one_process():
    """The whole batch in one process, the bf16 layer stepped through fp32 masters (01-05's way)."""
    model = make_mixed()
    ref = train_whole_batch(model, optimizers.MixedPrecisionAdamW(optimizers.decay_groups(model, 0.0), 0.0,
                                                                  **adamw(1e-2)), STEPS)
    return {**ref, "params": {n: p.float() for n, p in ref["params"].items()}}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("lesson", AS_DDP)
def test_01_to_05_train_two_dtypes_as_ddp(world, lesson):
    assert make_mixed().hidden.weight.dtype == torch.bfloat16 and make_mixed().emb.weight.dtype == torch.float32
    initial = {n: p.detach().float() for n, p in make_mixed().named_parameters()}
    for out in results(world):
        identical(out[lesson], out["ddp"])
        bf16_close(out["ddp"], one_process(), initial, world)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("lesson", list(AS_FSDP2))
def test_06_to_08_train_two_dtypes_as_fsdp2(world, lesson):
    for out in results(world):
        identical(out[lesson], out[AS_FSDP2[lesson]])


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("lesson", ["09"])  # (the id `make test LESSON=09` selects by)
def test_09_refuses_two_dtypes_in_one_line(world, lesson):
    for out in results(world):
        assert out[lesson] == "09 keeps every parameter in one flat buffer: one dtype and device, not 2"
