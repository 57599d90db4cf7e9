"""Each optional feature lives in one folder (issue 43, "features as plug-ins"): the files that
name a feature outside its home are what the next feature would cost. Counted here for
executor_svc only (the scheduler and frontend halves are counted once their homes exist); the
limits are where the executor stands now, so a feature that spreads again fails this test.

Also: the executor's step functions iterate hooks and branch on no feature, and stay short.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Feature -> (what names it, case-insensitive; its home in each service).
FEATURES = {
    "lora": (r"lora", {"executor_svc": "executor_svc/features/lora"}),
    "speculative": (
        r"speculat|\bdraft|spec_token|spec_verify|num_spec",
        {"executor_svc": "executor_svc/features/spec"},
    ),
    "structured outputs": (
        r"token_mask|structured|grammar|guided",
        {"executor_svc": "executor_svc/features/structured"},
    ),
    "pooling": (r"pooling|pooled", {"executor_svc": "executor_svc/features/pooling"}),
}
# Files of executor_svc naming each feature outside its home, at most (main before issue 43:
# LoRA 16, speculative 9, structured outputs 5, pooling 5). What is left: the CLI flags, the
# registry that lists every feature, the runner's constructor options and ScheduledSequence's
# per-step fields, the SeqState fields the features own, and for LoRA the model layers' slot,
# its compiled kernel, the LoadLoraAdapter RPC and the tensor-parallel step message.
EXECUTOR_LIMITS = {"lora": 13, "speculative": 4, "structured outputs": 3, "pooling": 3}


def files_naming(pattern: str, package: str, home: str | None = None) -> list[str]:
    """The .py files of ``package`` whose text matches ``pattern``, outside ``home``."""
    rx = re.compile(pattern, re.IGNORECASE)
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if home is not None and rel.startswith(home + "/"):
            continue
        if rx.search(path.read_text()):
            out.append(rel)
    return out


def test_each_executor_feature_is_named_in_few_files_outside_its_home():
    counts = {}
    for name, (pattern, homes) in FEATURES.items():
        assert (ROOT / homes["executor_svc"]).is_dir(), homes["executor_svc"]
        counts[name] = files_naming(pattern, "executor_svc", homes["executor_svc"])
    over = {n: f for n, f in counts.items() if len(f) > EXECUTOR_LIMITS[n]}
    assert over == {}


def _function(path: str, qualname: str) -> ast.FunctionDef:
    tree = ast.parse((ROOT / path).read_text())
    *outer, name = qualname.split(".")
    body = tree.body
    for cls in outer:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)


STEP_FUNCTIONS = [
    ("executor_svc/runner/model_runner.py", "ModelRunner.execute"),
    ("executor_svc/api/validation.py", "validate_step"),
]


def test_the_executor_step_functions_branch_on_no_feature_and_fit_a_screen():
    anyone = "|".join(p for p, _ in FEATURES.values()) + "|prompt_logprob"
    wrong = []
    for path, qualname in STEP_FUNCTIONS:
        fn = _function(path, qualname)
        if fn.end_lineno - fn.lineno + 1 > 30:
            wrong.append(f"{qualname}: {fn.end_lineno - fn.lineno + 1} lines")
        for node in ast.walk(fn):
            if isinstance(node, (ast.If, ast.IfExp, ast.While)):
                test = ast.unparse(node.test)
                if re.search(anyone, test, re.IGNORECASE):
                    wrong.append(f"{qualname}: branches on {test}")
    assert wrong == []


def test_the_counter_sees_a_name(tmp_path):
    assert files_naming(r"lora", "executor_svc", "executor_svc/features/lora")
    assert "executor_svc/features/lora/manager.py" in files_naming(r"LoraManager", "executor_svc")
    assert files_naming(r"no such feature name", "executor_svc") == []
