"""Two builds of ember side by side in one run (a diagnostic, not a test): a timing tool of tools/
run alternately under this checkout's package and under an earlier revision's (or under this one
with a function replaced), each in a fresh process with its own empty cache, rows matched by
case and each arm's median printed beside the others'.

    python tools/tree_ab.py export 85f6de2 .ab/base         # here, where the git history is
    python tools/tree_ab.py run --arm base=.ab/base --rounds 2 -- tools/step_time.py --bf16 --cases airbench:1024
    python tools/tree_ab.py run --arm scalar=head --patch 'scalar:ember.codegen.cuda:_vector_step=lambda sub, low: 0' \\
        -- tools/step_time.py --bf16 --cases airbench:1024

`export` writes REV's package (the folders pyproject.toml maps to ember's subpackages, with their
templates and tuning records) under DIR/ember: a GPU machine's copy of the working tree has no git
history, so export here and carry DIR there. Arm "head" (always run, first in the table) is the
package installed from this checkout; `--arm NAME=DIR` adds one run from an exported folder and
`--arm NAME=head` one of the installed package again, which `--patch NAME:MODULE:ATTR=EXPR` then
alters in that arm's process before the tool runs (EXPR is evaluated with MODULE's globals).
Arms run in rotating order, `--rounds` times, with `EMBER_PLAN_CACHE=0`. A row is any JSON
object the tool prints on a line of its own with a "model" and a "batch" (step_time.py's and
kernel_times-like tools' rows); the table shows, per case, each arm's median of the first numeric
field of --metric present (default: step_us, step_ms) and its ratio to head's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the child's bootstrap: an arm's package first on the path, the editable install's finder gone,
#: the patches applied, then the tool run as __main__ with its own folder on the path
_BOOT = r"""
import importlib, json, os, runpy, sys
tree, patches, script, args = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4:]
if tree:
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (type(f).__module__ + repr(f)).lower()]
    sys.path.insert(0, tree)
import ember
where = os.path.dirname(os.path.abspath(ember.__file__))
if tree and not where.startswith(os.path.abspath(tree) + os.sep):
    raise SystemExit(f"tree_ab: ember imported from {where}, not from {tree}")
for module, attr, expr in patches:
    m = importlib.import_module(module)
    if not hasattr(m, attr):
        raise SystemExit(f"tree_ab: {module} has no {attr} to replace")
    setattr(m, attr, eval(expr, vars(m)))
print(f"tree_ab: ember from {where}" + (f", {len(patches)} patch(es)" if patches else ""), file=sys.stderr)
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
"""


def package_dirs(pyproject: str) -> dict[str, str]:
    """pyproject.toml's [tool.setuptools] package-dir: subpackage -> folder of the repository."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the one inline table this needs, read by pattern
        table = re.search(r"^package-dir\s*=\s*\{(.*?)\}", pyproject, re.M | re.S)
        return dict(re.findall(r'"([\w.]+)"\s*=\s*"([^"]+)"', table.group(1))) if table else {}
    return tomllib.loads(pyproject)["tool"]["setuptools"]["package-dir"]


def in_git_checkout() -> bool:
    """Whether git is here and this checkout's folder is a repository's top (not a copy inside another one)."""
    if shutil.which("git") is None:
        return False
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    return r.returncode == 0 and Path(r.stdout.strip()).resolve() == ROOT


def export(rev: str, dest: Path) -> Path:
    """Writes revision `rev`'s package under dest/ember (dest must not exist); returns dest."""
    if dest.exists():
        raise SystemExit(f"tree_ab: {dest} exists; export writes a new folder")
    if not in_git_checkout():
        raise SystemExit(f"tree_ab: export needs git and {ROOT} as a git checkout (export where the history is)")
    git = lambda *a: subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, check=True)  # noqa: E731
    try:
        mapping = package_dirs(git("show", f"{rev}:pyproject.toml").stdout.decode())
    except (subprocess.CalledProcessError, KeyError) as e:
        why = e.stderr.decode().strip() if isinstance(e, subprocess.CalledProcessError) else f"no {e} in it"
        raise SystemExit(f"tree_ab: cannot read the package folders of {rev}:pyproject.toml: {why}") from None
    if "ember" not in mapping:
        raise SystemExit(f"tree_ab: {rev}:pyproject.toml maps no package folders (tool.setuptools.package-dir)")
    folders = sorted(set(mapping.values()))
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "tree.tar"
        try:
            git("archive", "-o", str(archive), rev, *folders)
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"tree_ab: git archive {rev} {' '.join(folders)}: {e.stderr.decode().strip()}") from None
        with tarfile.open(archive) as tar:
            # the data filter where this Python has it (3.10.12+): no links or paths out of the folder
            extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(Path(tmp) / "src", **extra)
        staging = Path(tmp) / "out"
        # the top package first, then each subpackage's folder where its dotted name puts it
        for package in sorted(mapping, key=lambda p: p.count(".")):
            target = staging.joinpath(*package.split("."))
            shutil.copytree(Path(tmp) / "src" / mapping[package], target, dirs_exist_ok=True)
        shutil.copytree(staging, dest)
    (dest / "REVISION").write_text(git("rev-parse", rev).stdout.decode())
    return dest


def _arms(specs: list[str], patches: list[str]) -> dict[str, tuple[str, list[tuple[str, str, str]]]]:
    arms: dict[str, tuple[str, list[tuple[str, str, str]]]] = {"head": ("", [])}
    for spec in specs:
        name, _, where = spec.partition("=")
        if not name or not where or name in arms:
            raise SystemExit(f"tree_ab: --arm {spec!r}: expected NAME=DIR or NAME=head, a new name")
        if where != "head" and not (Path(where) / "ember" / "__init__.py").is_file():
            raise SystemExit(f"tree_ab: --arm {spec!r}: {where}/ember/__init__.py is missing (tree_ab.py export REV DIR)")
        arms[name] = ("" if where == "head" else str(Path(where).resolve()), [])
    for patch in patches:
        parts = patch.split(":", 2)
        if len(parts) != 3 or "=" not in parts[2] or parts[0] not in arms:
            raise SystemExit(f"tree_ab: --patch {patch!r}: expected ARM:MODULE:ATTR=EXPR of an --arm")
        attr, expr = parts[2].split("=", 1)
        arms[parts[0]][1].append((parts[1], attr.strip(), expr))
    return arms


def _rows(stdout: str) -> list[dict]:
    rows = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "model" in row and "batch" in row:
                rows.append(row)
    return rows


def run(arm_specs: list[str], patches: list[str], rounds: int, metrics: list[str], command: list[str],
        out: str = "") -> dict[str, dict[str, list[float]]]:
    """Runs `command` (a tool script and its arguments) under every arm, `rounds` times in rotating
    order; returns {case: {arm: [metric per round]}} and prints the table."""
    if not command or not command[0].endswith(".py"):
        raise SystemExit("tree_ab: after --, a tool script (tools/x.py) and its arguments")
    arms = _arms(arm_specs, patches)
    names = list(arms)
    found: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="tree_ab_") as tmp:
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                tree, arm_patches = arms[name]
                env = dict(os.environ, EMBER_CACHE_DIR=str(Path(tmp) / f"{name}.{r}"), EMBER_PLAN_CACHE="0")
                p = subprocess.run([sys.executable, "-c", _BOOT, tree, json.dumps(arm_patches), *command],
                                   capture_output=True, text=True, env=env)
                if p.returncode:
                    raise SystemExit(f"tree_ab: arm {name} round {r + 1} failed:\n{p.stderr[-3000:]}")
                print(f"round {r + 1} {name}: " + p.stderr.strip().splitlines()[0], file=sys.stderr, flush=True)
                for row in _rows(p.stdout):
                    metric = next((m for m in metrics if isinstance(row.get(m), (int, float))), None)
                    if metric is None:
                        continue
                    flags = "".join(f" {k}" for k in ("bf16", "tf32") if row.get(k))
                    case = f"{row['model']}:{row['batch']}{flags} {metric}"
                    found.setdefault(case, {}).setdefault(name, []).append(float(row[metric]))
    width = max([len(c) for c in found] + [4])
    print(f"{'case':{width}s}  " + "  ".join(f"{n:>16s}" for n in names))
    for case, by_arm in found.items():
        cells = []
        for n in names:
            values = by_arm.get(n)
            if not values:
                cells.append(f"{'-':>16s}")
                continue
            median = statistics.median(values)
            ratio = "" if n == "head" or not by_arm.get("head") else f" ({median / statistics.median(by_arm['head']):.3f})"
            cells.append(f"{median:>8.2f}{ratio:>8s}")
        print(f"{case:{width}s}  " + "  ".join(cells))
    if out:
        Path(out).write_text(json.dumps(found, indent=1) + "\n")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    e = sub.add_parser("export", help="write a revision's package under DIR/ember")
    e.add_argument("rev")
    e.add_argument("dest")
    r = sub.add_parser("run", help="run a tool under each arm, alternately")
    r.add_argument("--arm", action="append", default=[], help="NAME=DIR (an export) or NAME=head")
    r.add_argument("--patch", action="append", default=[], help="ARM:MODULE:ATTR=EXPR, applied in that arm")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--metric", default="step_us,step_ms", help="the row fields compared, the first present")
    r.add_argument("--out", default="", help="write {case: {arm: [values]}} here")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- tools/x.py ARGS")
    args = ap.parse_args()
    if args.what == "export":
        print(export(args.rev, Path(args.dest)))
        return
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    run(args.arm, args.patch, args.rounds, args.metric.split(","), command, args.out)


if __name__ == "__main__":
    main()
