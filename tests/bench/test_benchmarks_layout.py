"""benchmarks/ stays what its README promises: every script listed there (and every listed one
exists), none reaching into the engine's internals (the model runner, the block manager) instead of
the public API (LLM.engine_info(), engine.stats(), a server's routes), and scripts/ only the set-up
of a checkout. Reads files only: nothing here runs a benchmark."""

from __future__ import annotations

import re

from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
BENCHMARKS = ROOT / "benchmarks"
# What walking into the engine looks like (the grep): the public API has no such attributes.
INTERNALS = re.compile(r"engine\.runner|\.block_manager\.|\.runner\.model")
# A script or folder named in the README's tables: `name.py`, `name.sh`, `name/`.
LISTED = re.compile(r"`([\w.-]+(?:\.py|\.sh|/))`")


def _scripts() -> set[str]:
    """Every script under benchmarks/, as its README names it: its path below the subject folder's
    (a helper folder such as vllm_isa_shim/ counts once, as itself)."""
    names = set()
    for path in BENCHMARKS.rglob("*"):
        rel = path.relative_to(BENCHMARKS)
        if "__pycache__" in rel.parts or not path.is_file() or path.suffix not in (".py", ".sh"):
            continue
        names.add(rel.parts[1] + "/" if len(rel.parts) > 2 else path.name)
    return names


def test_every_benchmark_is_in_the_readme_and_every_listed_one_exists():
    readme = (BENCHMARKS / "README.md").read_text()
    listed = set(LISTED.findall(readme)) - {"benchmarks/", "scripts/"}
    scripts = _scripts()
    assert scripts, "no scripts found under benchmarks/"
    assert not scripts - listed, f"in benchmarks/ but not in its README: {sorted(scripts - listed)}"
    missing = {name for name in listed if name.endswith((".py", ".sh")) and name not in scripts
               and not (ROOT / "scripts" / name).exists()}
    assert not missing, f"named in benchmarks/README.md but not there: {sorted(missing)}"


def test_no_benchmark_reaches_into_the_engine():
    offenders = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
                 for folder in (BENCHMARKS, ROOT / "chatserve" / "bench", ROOT / "scripts")
                 for path in sorted(folder.rglob("*")) if path.suffix in (".py", ".sh")
                 for n, line in enumerate(path.read_text().splitlines(), 1) if INTERNALS.search(line)]
    assert not offenders, "read these through LLM.engine_info() / engine.stats():\n" + "\n".join(offenders)


def test_scripts_holds_only_the_set_up():
    python_files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scripts").rglob("*.py"))
    assert len(python_files) <= 6, python_files
    assert (ROOT / "scripts" / "setup_env.sh").exists()
