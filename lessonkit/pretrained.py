"""--init-from FILE: start a lesson from a plain PyTorch state_dict of model.GPT, one file, as
scripts/learn/consolidate.py writes it or `torch.save(GPT(cfg).state_dict(), FILE)` in any code
(docs/checkpoints.md). Every rank reads it (mmap: pages are read as they are copied), checked
against the model's names and shapes before any parameter is touched; it replaces the seeded
initial weights, in fp32, before a bf16 or fp16 run rounds them."""
import torch

from lessonkit.reshard import CheckpointError


def load(path, model):
    """{name: tensor} from `path` for each parameter of `model` (GPT's names; a tied parameter by
    either of its names), or a CheckpointError saying in one line why the file is not one."""
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # missing, a folder, not a torch.save file, truncated
        raise CheckpointError(f"--init-from {path}: cannot read it: {str(e).strip().splitlines()[0]}") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in sd.items()):
        raise CheckpointError(f"--init-from {path}: not a state_dict ({{name: tensor}})")
    names = {}  # each parameter once, by every name it has (lm_head.weight is wte.weight)
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    out, problems = {}, []
    for p, aliases in names.items():
        found = next((n for n in aliases if n in sd), None)
        if found is None:
            problems.append(f"no {aliases[0]}")
        elif sd[found].shape != p.shape:
            problems.append(f"{found} is {list(sd[found].shape)}, this model's {list(p.shape)}")
        else:
            out.update({n: sd[found] for n in aliases})
    known = {n for aliases in names.values() for n in aliases} | set(model.state_dict())
    problems += [f"{n} is not this model's" for n in sd if n not in known]
    if problems:
        raise CheckpointError(f"--init-from {path}: not this model's weights (check the model flags): "
                              + "; ".join(problems[:3]) + (f"; {len(problems) - 3} more" if len(problems) > 3 else ""))
    return out


def init_from(path, model):
    """With a path (--init-from), `model`'s parameters become the file's; with None, nothing happens."""
    if path:
        copy_into(model, load(path, model))


@torch.no_grad()
def copy_into(module, weights, prefix=""):
    """Copy `weights` into `module`'s parameters (names under `prefix`, as in the whole model)."""
    for name, p in module.named_parameters():
        p.copy_(weights[f"{prefix}.{name}" if prefix else name])
