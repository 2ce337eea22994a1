"""Write the student edition: this project with the solution regions of the lessons cut out.

    python -m scripts.course.student_edition student/                   # or: make student-edition OUT=student
    python -m scripts.course.student_edition student/ --level standard  # goals only, no recipe
    python -m scripts.course.student_edition out/ --source student/     # from an edition: the same bytes
    python -m scripts.course.student_edition --check                    # only check the fences and recipes

A solution region is fenced by comments, with what must hold right after BEGIN:

    # ### BEGIN SOLUTION: <short title>
    # GOAL: <what must hold afterwards, its invariants; no calls named>
    #       <more lines: '#' then at least two spaces>
    <the solution: whole statements at the fence's indentation>
    # ### END SOLUTION

The guided level's recipes (which collective, in which order, shapes) are course material, in
recipes.toml by file and title. In the edition the solution becomes one line at the fence's
indentation, `raise NotImplementedError("<file>: <title> (see the TODO above)")`, after the recipe
as `# TODO:` lines in place of the GOAL (level standard: the GOAL stays, "see the GOAL above"), so
every file still imports and a test that reaches the region fails with that message. The fences
and instructions stay: the student writes between them, and stripping an edition again changes
nothing (its TODOs stay). A region with no recipe, or a recipe with no region, is an error. Only
top-level *.py files are fenced (the lessons, bucket.py and shard.py); everything else is copied as it is,
except what would show the solutions or grade them (SKIP_PATHS: the diffs between lessons, the
hidden tests, the kit's own tests, the answer key, the recipes). The output depends only on the
source's files (no timestamps), so generating twice gives identical bytes.
"""
import os
import pathlib
import re
import stat
import subprocess
import sys
import textwrap
import tomllib

from scripts.runs import ROOT, Parser

STAMP = "ASSIGNMENT.md"  # marks a directory as an edition: safe to regenerate, never a source
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ipynb_checkpoints", "runs"}
# The diffs between consecutive lessons contain every solution (and their test needs them).
# The hidden tests are the grader's (scripts/course/grade.py adds them from the instructor's
# checkout). The tests of the course kit hold this checkout's solutions to passing: in an edition
# they would fail for reasons that are not the student's (so would the house rules' line counts,
# with the solutions cut). The instructor's guide, the answer key and the recipes (they would
# name every call in a standard edition).
SKIP_PATHS = {"docs/diffs", "tests/test_diffs.py", "tests/hidden", "tests/test_assignments.py",
              "tests/test_course.py", "tests/test_house.py", "docs/course.md", "docs/course_answers.md",
              "scripts/course/recipes.toml"}
LEVELS = {"guided": "TODO", "standard": "GOAL"}  # --level: the instruction kept in the edition
QUESTIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "questions.toml")
RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes.toml")
BEGIN = re.compile(r"^([ \t]*)# ### BEGIN SOLUTION:[ \t]*(\S.*?)[ \t]*$")
END = re.compile(r"^([ \t]*)# ### END SOLUTION[ \t]*$")
ANY = re.compile(r"#\s*###\s*(BEGIN|END)\s+SOLUTION")  # a fence, well-formed or not


class FenceError(ValueError):
    pass


# ----------------------------------------------------------------------------- fences
def regions(text, name):
    """[(begin, end, indent, title, blocks)] line indices of each fenced region of `text`, with
    blocks {"GOAL" | "TODO": (first line, line after)} of its instructions; FenceError naming file
    and line for a fence that is unbalanced, nested or malformed."""
    lines, found, open_ = text.splitlines(), [], None
    for i, line in enumerate(lines):
        where = f"{name}:{i + 1}"
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if open_ is not None:
                raise FenceError(f"{where}: BEGIN SOLUTION inside the region opened at line {open_[0] + 1}")
            open_ = (i, begin.group(1), begin.group(2))
        elif end:
            if open_ is None:
                raise FenceError(f"{where}: END SOLUTION without a BEGIN SOLUTION")
            start, indent, title = open_
            if end.group(1) != indent:
                raise FenceError(f"{where}: END SOLUTION is not indented like its BEGIN (line {start + 1})")
            found.append((start, i, indent, title, _instructions(lines, start, i, indent, name)))
            open_ = None
        elif ANY.search(line):
            raise FenceError(f"{where}: malformed fence (want '# ### BEGIN SOLUTION: <title>' "
                             f"or '# ### END SOLUTION'): {line.strip()}")
    if open_ is not None:
        raise FenceError(f"{name}:{open_[0] + 1}: BEGIN SOLUTION ({open_[2]}) has no END SOLUTION")
    return found


def _instructions(lines, start, end, indent, name):
    """{label: (first, after)} of the GOAL (the checkout's) and TODO (a guided edition's) blocks
    after BEGIN, each once with its lines '#  ...'; checks the body after them is whole statements."""
    blocks, j = {}, start + 1
    while j < end:
        label = next((l for l in ("GOAL", "TODO") if lines[j].startswith(f"{indent}# {l}:")), None)
        if label is None:
            break
        if label in blocks:
            raise FenceError(f"{name}:{j + 1}: a second '# {label}:' in one region")
        first, j = j, j + 1
        while j < end and re.match(re.escape(indent) + r"#  ", lines[j]):
            j += 1
        blocks[label] = (first, j)
    if not blocks:
        raise FenceError(f"{name}:{start + 2}: a region starts with '# GOAL: <what must hold>' "
                         "(an edition's: '# TODO: <the recipe>')")
    body = [(k, lines[k]) for k in range(j, end) if lines[k].strip()]
    if not body:
        raise FenceError(f"{name}:{start + 1}: the region holds no code")
    for j, line in body:  # inside the fence's block, so that a raise can replace it all
        if not line.startswith(indent):
            raise FenceError(f"{name}:{j + 1}: region code indented less than its fence")
    j, first = body[0]
    if len(first) - len(first.lstrip()) != len(indent):
        raise FenceError(f"{name}:{j + 1}: the region's first statement is not at the fence's indentation")
    return blocks


def message(name, title, label="TODO"):
    return f"{name}: {title} (see the {label} above)"


def course_file(path):
    """QUESTIONS: {lesson: {"run": command, "questions": [...]}} (answers: docs/course_answers.md);
    RECIPES: {file: {title: recipe}}. {} where the file is absent (an edition has no recipes)."""
    return tomllib.loads(pathlib.Path(path).read_text("utf-8")) if os.path.exists(path) else {}


def strip(text, name, level="guided", recipes=None):
    """`text` with every region's solution replaced by a NotImplementedError and the level's
    instructions: guided, a TODO kept or else the recipe ({title: recipe}; default: recipes.toml's
    for `name`) in place of the GOAL; standard, the GOAL (an edition's TODO stays). Checked to compile."""
    lines = text.splitlines(keepends=True)
    newline = "\r\n" if text.endswith("\r\n") else "\n"
    out, last = [], 0
    for start, end, indent, title, blocks in regions(text, name):
        label = "TODO" if level == "guided" or "GOAL" not in blocks else "GOAL"  # an edition's TODO stays
        if label in blocks:
            kept = lines[slice(*blocks[label])]
        else:  # a checkout's region at guided: its recipe, wrapped to 100 columns
            recipes = course_file(RECIPES).get(name, {}) if recipes is None else recipes
            if title not in recipes:
                raise FenceError(f"{name}:{start + 1}: region '{title}' has no recipe in "
                                 f"scripts/course/recipes.toml (under [\"{name}\"])")
            kept = [l + newline for l in textwrap.wrap(
                recipes[title], 100, initial_indent=f"{indent}# TODO: ", subsequent_indent=f"{indent}#       ",
                break_long_words=False, break_on_hyphens=False)]
        msg = message(name, title, label).replace("\\", "\\\\").replace('"', '\\"')
        out += lines[last:start + 1] + kept
        out.append(f'{indent}raise NotImplementedError("{msg}"){newline}')
        last = end
    out += lines[last:]
    result = "".join(out)
    try:
        compile(result, name, "exec")
    except SyntaxError as e:
        raise FenceError(f"{name}:{e.lineno}: the stripped file is not valid Python ({e.msg}); "
                         "a region must be whole statements") from None
    return result


# ----------------------------------------------------------------------------- files
def _skipped(rel, skip_paths=True):
    parts = rel.split("/")
    return (any(p in SKIP_DIRS for p in parts[:-1]) or parts[-1].endswith(".pyc")
            or skip_paths and any(rel == s or rel.startswith(s + "/") for s in SKIP_PATHS))


def source_files(source, skip=True):
    """Relative paths of the project's files: git's view (tracked and new, not ignored) when
    `source` is a git checkout, else every file; minus SKIP_DIRS, SKIP_PATHS (unless not `skip`)
    and any edition inside it."""
    if os.path.isdir(os.path.join(source, ".git")):
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=source, capture_output=True, check=True).stdout.decode()
        files = sorted({f for f in out.split("\0") if f and os.path.isfile(os.path.join(source, f))})
    else:
        files = []
        for dirpath, dirnames, filenames in os.walk(source):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
            rel = os.path.relpath(dirpath, source).replace(os.sep, "/")
            files += [f if rel == "." else f"{rel}/{f}" for f in filenames]
        files.sort()
    editions = {os.path.dirname(f) for f in files if os.path.basename(f) == STAMP and "/" in f}
    return [f for f in files if not _skipped(f, skip) and f != STAMP
            and not any(f.startswith(e + "/") for e in editions)]


def edition(source, level="guided"):
    """{relative path: (bytes, mode)} of the student edition of `source` at `level`; FenceError
    for a bad fence, a region with no recipe (at guided) or a recipe with no region."""
    out, listed, known = {}, [], course_file(RECIPES)
    for rel in source_files(source):
        path = os.path.join(source, rel)
        data = pathlib.Path(path).read_bytes()
        if "/" not in rel and rel.endswith(".py"):
            text = data.decode("utf-8")
            found = regions(text, rel)
            if found:
                data = strip(text, rel, level, known.get(rel, {})).encode("utf-8")
                listed += [(rel, title) for _, _, _, title, _ in found]
        out[rel] = (data, stat.S_IMODE(os.stat(path).st_mode))
    for rel, title in ((r, t) for r, titles in known.items() for t in titles if (r, t) not in listed):
        raise FenceError(f"scripts/course/recipes.toml: the recipe [\"{rel}\"] \"{title}\" has no region "
                         f"in {rel} (renamed or removed?)")
    out[STAMP] = (_stamp(listed, level).encode("utf-8"), 0o644)
    return out


def _stamp(listed, level):
    rows = "\n".join(f"- `{rel}`: {title}" for rel, title in listed)
    how = ("what must hold when it is done (its invariants);\nwhich calls get you there is yours to "
           "choose" if level == "standard" else "what to write, step by step")
    asked = []
    for lesson, q in course_file(QUESTIONS).items():
        items = "\n".join(f"{i}. {text}" for i, text in enumerate(q["questions"], 1))
        asked.append(f"### {lesson}\n\nRun `{q['run']}` once your regions pass. Write your prediction "
                     f"first, then compare with what the run prints.\n\n{items}")
    asked = "\n\n".join(asked)
    return f"""# Student edition (level: {level})

Generated by `scripts/course/student_edition.py`. The solutions are cut out of these regions; each is
fenced by `# ### BEGIN SOLUTION: <title>` and `# ### END SOLUTION`, and its `# {LEVELS[level]}:` lines say
{how}.
Replace the `raise NotImplementedError(...)` between the fences with your code.

{rows}

`bucket.py` belongs to lesson 03 (graded by `tests/test_bucket.py`) and `shard.py` to lesson 04 (graded by
04's tests; `04_zero1.py` itself has no region); 05 uses both.

## Set up, once

    make setup                  # .venv: the pinned torch (CPU build without a GPU), pytest, numpy
    PYTHON=python3 make demo    # or skip .venv: your own Python with torch >= 2.6 and pytest

## Work on one lesson

    .venv/bin/python -m pytest -q tests/test_01_vanilla.py    # its visible tests
    .venv/bin/torchrun --nproc_per_node=2 01_vanilla_dp.py    # run it (python 01_vanilla_dp.py: 1 rank)
    make grade                                                # the grade table, visible tests only
    make test                                                 # the whole suite (minutes): passes once every region does

Points per lesson are in `tests/points.toml`. Your instructor grades with the tests shipped here
(visible) and held-back ones (hidden: other world sizes, model shapes, bucket caps, edge cases),
so passing the visible tests is necessary, not sufficient: keep to the invariants, not to the tests.

## Questions: predict, then measure

{asked}
"""


def write(files, out_dir, source):
    """Make `out_dir` hold exactly `files` (build caches aside); refuses a directory that is not
    an edition, so a student's work or the solutions are never overwritten by mistake."""
    out_dir, source = os.path.realpath(out_dir), os.path.realpath(source)
    if out_dir == source or source.startswith(out_dir + os.sep):
        raise SystemExit(f"error: {out_dir} is the source (or holds it); write the edition elsewhere")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.exists(os.path.join(out_dir, STAMP)):
        raise SystemExit(f"error: {out_dir} exists and is not a student edition (no {STAMP}); not touching it")
    for rel in source_files(out_dir) if os.path.isdir(out_dir) else []:
        if rel not in files:  # left over from an older edition
            os.remove(os.path.join(out_dir, rel))
    for rel, (data, mode) in sorted(files.items()):
        path = os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.isfile(path) or pathlib.Path(path).read_bytes() != data:
            pathlib.Path(path).write_bytes(data)
        os.chmod(path, mode)
    for dirpath, _, _ in sorted(os.walk(out_dir), reverse=True):  # dirs emptied by the removals
        if dirpath != out_dir and not os.listdir(dirpath):
            os.rmdir(dirpath)


def main(argv=None):
    p = Parser("student_edition", description=__doc__)
    p.add_argument("out_dir", nargs="?", help="where to write the edition (e.g. student/)")
    p.add_argument("--source", default=ROOT, help="the project to strip (default: this checkout)")
    p.add_argument("--level", choices=sorted(LEVELS), default="guided",
                   help="guided: recipes.toml's recipes as TODOs (default); standard: the GOALs, no calls named")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 on a bad fence or recipe")
    a = p.parse_args(argv)
    if not a.check and not a.out_dir:
        p.error("OUT_DIR is required (or --check)")
    if not os.path.isdir(a.source):  # (else: "no region" for every recipe)
        p.error(f"--source {a.source}: no such directory")
    try:
        files = edition(a.source, a.level)
    except FenceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n = files[STAMP][0].decode().count("\n- `")
    if a.check:
        print(f"fences: {n} regions, all closed")
        return 0
    try:
        write(files, a.out_dir, a.source)
    except OSError as e:
        print(f"error: cannot write the edition to {a.out_dir}: {e.strerror}: {e.filename}", file=sys.stderr)
        return 1
    print(f"wrote {len(files)} files to {a.out_dir} ({n} solution regions cut out, level {a.level})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
