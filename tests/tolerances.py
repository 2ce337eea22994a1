"""The parity tolerances more than one test file uses, each with its reason, written once.
(Bounds with a single user stay beside it: zero_parity's KEY_BIAS_ATOL and bf16 bounds for 04
and 05, test_06_zero3's bf16 bounds; the end of this file says why those differ.)"""

# fp32 parity (every lesson at 1, 2 and 4 ranks; the hidden suite at 3): the ranks average N
# per-rank means where the reference takes one mean over the whole batch, so sums are formed in
# another order (and in 04-06 the clipping norm is summed shard by shard). The difference is
# float round-off (~1e-7 relative per step) that Adam can amplify a little over a parity run's
# few steps (measured <= 8e-7 for 04 and 05). 1e-5 is far below the ~1e-2 (or more) that a
# wrong result causes: a sum instead of a mean, a missed parameter, an unreduced micro-step
# (01, 02); a bucket not reduced, a gradient outside its bucket (03); a shard updated from
# another slice, a stale all-gather or shard, a padding element that leaks (04, 05); a wrong
# shard, a stale or missing parameter, a lost gradient (06).
TOL = dict(rtol=1e-5, atol=1e-5)
# Gradients, compared before Adam sees them (harness.recording says why): the same round-off
# argument as TOL; a wrong scale (a missing 1/N) is off by 50% or more.
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)

# How far Adam can move one element over a parity run, whatever its gradient: Adam's step
# m/sqrt(v) is about lr per element whatever the gradient's size, so a gradient that is only
# rounding (or noise) still moves its element, by up to about 2 x lr x steps. The GPT runs held
# to it (the ARGV of 01-03 and of zero_parity) are 6 steps at the default lr 3e-3: 0.036.
LR, STEPS = 3e-3, 6
ADAM_REACH = 2 * LR * STEPS
# So in fp32 a few elements may leave TOL: one whose gradient nearly cancels (a sum of terms of
# both signs, far smaller than the terms) carries the summation order's round-off, relative to
# the terms, into Adam's normalised step. Measured: 1.3e-5 on one element of 3,675 (a value
# weight of 08 at 2 x 2 against one process, test_checkpoint, on a 2-core AMD EPYC with AVX2:
# its kernels sum in another order than the CPUs the suite had run on, where every element
# stayed within TOL), 6e-7 at most on every other. A tensor may have ADAM_FEW of its elements
# (at least one) beyond TOL, each within ADAM_FEW_ATOL, 7x that measurement (zero_parity.close):
# a wrong shard or a stale moment moves whole ranges by ~1e-2, and one element's lost or
# misplaced gradient (a shard's edge, a padding element) moves it by about lr per step, 3e-3.
ADAM_FEW, ADAM_FEW_ATOL = 1e-3, 1e-4

# bf16 parity of the replicated lessons (02, 03; harness.bf16_close) with the bf16 reference,
# element by element: parameters, gradients and the all-reduce are bf16, whose 8-bit significand
# rounds to 2^-9 = 0.2% relative. The reference rounds one whole-batch gradient; the ranks round
# their own halves, then the division and the sum, so gradient elements differ by a few bf16
# ulps. Adam turns a small gradient's rounding into a whole update, so a parameter can drift by
# up to ADAM_REACH = 0.036 in the worst case (measured: 0.014, on attention biases near 0), and
# bf16 values near 1 (LayerNorm weights) are one ulp = 2^-7 apart. Losses (fp32 cross-entropy of
# bf16 logits) measured 2e-4 apart at most; 2e-3 leaves 10x margin. (The exact checks of the
# algorithm are the fp32 ones and the bit-for-bit comparison with DDP.)
BF16_LOSS_TOL = dict(rtol=0, atol=2e-3)
BF16_PARAM_TOL = dict(rtol=2 ** -7, atol=ADAM_REACH)

# fp16 parity of every lesson (tests/test_fp16.py) with the fp16 reference and its loss scaler: the
# same argument as bf16's with an 11-bit significand (2^-11 = 0.05% per rounding). Measured at 2 ranks
# on test_fp16's GPT (6 steps, lr 3e-3): losses <= 1.1e-4 apart, parameters <= 0.0057 (0.0085 with
# 2 micro-steps in 03; 04: 0.0053, 05 with 2 micro-steps: 0.0052; 06, 07 and 08 at --shard-group 1,
# with 2 micro-steps: 0.0057), about 2-3 Adam updates on elements whose gradient is rounding, no closer than
# the fp16 reference is to the fp32 one (0.006). Loss: 1e-3, 10x margin, below what a step skipped
# or a micro-step lost moves a loss here (0.01-0.05). Parameters: ADAM_REACH / 2 (2x margin), and
# one fp16 ulp near 1 (2^-10). The exact check is test_fp16's bit-for-bit one, against DDP with
# torch.amp.GradScaler (04, 05 too), and 06-08's against FSDP2 with ShardedGradScaler: Adam hides a
# gradient's scale, so a scale not undone shows only there.
FP16_LOSS_TOL = dict(rtol=0, atol=1e-3)
FP16_PARAM_TOL = dict(rtol=2 ** -10, atol=ADAM_REACH / 2)

# The sharded lessons hold bf16 to bounds of their own, each set between what its correct run
# and its likely bug measure on its own GPT, and by its own measure of the parameters' distance:
# - 04, 05 (zero_parity.BF16_LOSS_ATOL = 5e-3, BF16_UPDATE_RTOL = 3%): the distance over the
#   distance the reference moved (its update), and every element within KEY_BIAS_ATOL
#   (= ADAM_REACH). The bug, AdamW in bf16 without master weights, is 6.2% of the update away:
#   the update bound catches it, and the loss bound is set against a step's change (~0.03).
# - 06 (test_06_zero3.ZERO3_BF16_LOSS_ATOL = 5e-4, ZERO3_BF16_PARAM_RTOL = 6e-3): the distance
#   over the weights' own norm, no bound per element. The bug, no fp32 master weights, measures
#   only 1.6x (losses) and 1.4x (weights) above these bounds, so the loss bound is 10x tighter.

# ----------------------------------------------------------------------------- FUZZ (tests/fuzz.py)
# The differential fuzzer compares each lesson with its PyTorch counterpart and with single-process
# training, on drawn models (widths 1-13, 1-3 steps, 1-4 ranks, AdamW at lr 1e-2, SGD with or
# without momentum at lr 0.5), loss by loss and parameter by parameter. Measured on 144 fp32 and
# 144 bf16 cases (about 25,000 parameter tensors compared each; PyTorch's runs against one
# process included, so the bounds hold for PyTorch's own round-off first):
# - fp32: TOL, element by element, for the reason TOL gives. The worst element measured was at
#   3% of it (Adam included: every drawn gradient stands well above fp32 round-off). A wrong
#   result is ~1e-2 or more, as TOL says, and losses off by a micro-step or a factor N show at once.
FUZZ_TOL = TOL
# - bf16 AdamW runs with eps = 1e-3 (fp32: 1e-8, as every lesson's default). Adam's early steps
#   move an element by about lr whatever its gradient (ADAM_REACH's argument): an element whose
#   gradient is within bf16 rounding of 0 moves by +lr in one run and -lr in another, and in a
#   drawn bias of 1-7 elements that is most of the update (measured: 75% with eps 1e-8). With
#   eps above that rounding, such an element moves in proportion to its gradient (as SGD), so two
#   correct runs differ in proportion to the rounding (measured: <= 10% with eps 1e-3); any
#   gradient well above 1e-3 still gets Adam's full, normalised step.
FUZZ_BF16_ADAM_EPS = 1e-3
# - bf16 parameters, per tensor: |got - want| <= FUZZ_BF16_UPDATE_RTOL x |want - initial| (2-norms),
#   the distance over how far the reference moved them (as zero_parity's bf16 bound), each
#   element's difference first less one bf16 ulp of it (fuzz.ulp, at most 2^-7 of the element).
#   Compared as fp32 master weights where both runs hold them (the reference, 01-03 and DDP
#   through their MixedPrecisionAdamW; 06 and FSDP2, whose shards are fp32), else as bf16 working
#   copies (04, 05; frozen parameters). The ulp: a working copy's rounding can flip to the next
#   bf16 value on any difference in the masters below it, and a difference in the masters below
#   it is one the bf16 weights cannot show (it matters where an update is tiny: a (1,)-bias that
#   moved 5e-5 with 1e-4 of round-off between DDP and one process). What is left is the
#   gradients' bf16 rounding (2^-9 per rounding) carried through 1-3 steps; measured <= 22% (one
#   tensor of 25,000: a (1, 7) weight whose update is 1/300 of it, where DDP and FSDP2 are as far
#   from one process), under 10% elsewhere. The bugs it is there for move a tensor by a whole
#   update or more: an update lost (no fp32 master weights: a step below one bf16 ulp is rounded
#   away), the sum of N ranks' gradients with SGD (N - 1 updates), a stale shard.
FUZZ_BF16_UPDATE_RTOL = 0.5
# - ... or FUZZ_BF16_FLOOR_ULPS bf16 ulps of the tensor, if more (2-norms of fuzz.ulp). A bf16
#   gradient rounds at the scale of its largest partial sums (tokens, micro-steps, ranks; with
#   SGD, the weight decay its step nets against), not of the net step, so a tensor whose update is
#   a few ulps of its weights is moved by rounding as far as by the step. Seed 20261213 drew one:
#   a (1,)-bias moved 5 ulps (SGD, lr 0.5, weight decay 0.1), and DDP ended 4 ulps from one
#   process (3 less the ulp above: 60% of the update), FSDP2 and 06-08 3, 01-05 2. A bug's whole
#   update or factor N still shows on the case's other tensors, and in its losses. fp16: none (its
#   runs measured within 0.13% of the update, below; 4 fp16 ulps hid 01 made to sum its ranks'
#   gradients instead of averaging them, off by 10% of an update with AdamW, seed 99).
FUZZ_BF16_FLOOR_ULPS = 4
# - bf16 losses (fp32 cross-entropy of bf16 logits, averaged over ranks): measured <= 0.016
#   apart (0.007 for all but one case); 0.05 leaves 3x margin. A micro-step's gradient lost or a
#   factor N in SGD's step moves the next loss by 0.05 to 0.5 on these models (seen on lessons
#   broken on purpose); the parameters' bound catches the rest.
FUZZ_BF16_LOSS_ATOL = 0.05
# - ... unless PyTorch's own implementations are farther: a drawn case can be chaotic in bf16
#   (momentum SGD at lr 0.5 on a 5-token model: losses 9.3, 4.9, 8.1, each step amplifying the
#   last step's rounding), where DDP and FSDP2 themselves end 0.09-0.13 from one process and any
#   change in the order of a sum moves the loss as much. There a lesson is held to
#   FUZZ_BF16_PYTORCH_SPREAD x the farthest counterpart's distance: as correct as PyTorch is, with
#   the same margin as above. (A lost micro-step or a factor N moves a loss by 0.05-0.5: masked in
#   such a case only where PyTorch's own spread is as large, and caught in the others.)
FUZZ_BF16_PYTORCH_SPREAD = 2
# - fp16 (01-05 so far; each run with its loss scaler: tests/fuzz.py LOSS_SCALES), derived from
#   bf16's by the rounding: fp16 keeps 11 significant bits, bf16 8, so each rounding of a gradient
#   or a working copy is 2^-12 against 2^-9 relative, 8 times finer, and the bf16 bounds above,
#   divided by 8, bound the same arguments (the loss scale adds no rounding of its own: x 2^k and
#   x 2^-k are exact). Parameters compared as in bf16, less one fp16 ulp each (fuzz.ulp; fp16's
#   subnormals, below 2^-14, are 2^-24 apart). Measured on 104 drawn fp16 cases (all three loss
#   scalers, 1-4 ranks; 1,176 pairs of runs that skipped the same steps, PyTorch's against one
#   process included): parameters <= 0.13% of the update, losses <= 8.6e-4 (SGD at lr 0.5): 48x
#   and 7x below the bounds. The bugs are the bf16 ones plus fp16's own, each a whole update or more: a gradient not
#   unscaled (x S, SGD's step 256 times or more too long), a step taken on an inf, a step skipped
#   on one rank only (the replicas differ), a scale not backed off (its steps skipped for good).
#   AdamW's eps as in bf16 (FUZZ_BF16_ADAM_EPS, for bf16's reason: a gradient that is only
#   rounding moves its element by lr either way) and for one more: with eps 1e-8 Adam divides any
#   common factor out of a gradient, so a loss scale left in the gradients would not show in
#   AdamW's cases; with 1e-3 it does wherever gradients are small. FUZZ_BF16_PYTORCH_SPREAD holds
#   for fp16 too.
FUZZ_FP16_ADAM_EPS = FUZZ_BF16_ADAM_EPS
FUZZ_FP16_UPDATE_RTOL = FUZZ_BF16_UPDATE_RTOL / 8
FUZZ_FP16_LOSS_ATOL = FUZZ_BF16_LOSS_ATOL / 8
