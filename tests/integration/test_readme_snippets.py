"""Every snippet of README.md's "Using llmserve with …" section, run as written against a live
stack serving SmolLM2-135M-Instruct: only the frontend's address and the model's directory are
substituted. A README edit that breaks a snippet, or drops one, fails here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_URL = "http://127.0.0.1:8000"
README_MODEL_DIR = "/models/SmolLM2-135M-Instruct"
# <!-- snippet: NAME --> right above a fenced block marks that block as run here.
SNIPPET = re.compile(r"<!-- snippet: (\S+) -->\n```(python|bash)\n(.*?)```", re.DOTALL)


def readme_snippets() -> dict[str, tuple[str, str]]:
    """name -> (language, code), in README order."""
    text = (ROOT / "README.md").read_text()
    found = SNIPPET.findall(text)
    snippets = {name: (lang, code) for name, lang, code in found}
    assert len(snippets) == len(found), "two snippets share a name"
    return snippets


@pytest.fixture(scope="module")
def llmserve_stack(smollm2_stack):  # the frontend fixture's stack: SmolLM2 (conftest)
    return smollm2_stack


def test_the_section_has_every_client():
    assert list(readme_snippets()) == [
        "openai",
        "openai-embeddings",
        "langchain",
        "lm-eval",
        "guidellm",
    ]


def _run(name: str, base_url: str, model_dir: Path, workdir: Path) -> str:
    """Run snippet `name` in `workdir` (where it may leave files: guidellm writes its reports to
    the working directory), with the repository's tests/ reachable from there as from the
    repository's root."""
    (workdir / "tests").symlink_to(ROOT / "tests")
    lang, code = readme_snippets()[name]
    assert README_URL in code, f"snippet {name} does not talk to {README_URL}"
    code = code.replace(README_URL, base_url).replace(README_MODEL_DIR, str(model_dir))
    bin_dir = str(Path(sys.executable).parent)  # lm_eval, guidellm: the test's own venv
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = (
        [sys.executable, "-c", code]
        if lang == "python"
        else ["bash", "-euo", "pipefail", "-c", code]
    )
    done = subprocess.run(
        cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"{name}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_openai_snippet(frontend, smollm2_dir, tmp_path):
    out = _run("openai", frontend.base_url, smollm2_dir, tmp_path)
    chat, *_, response = out.strip().splitlines()
    assert chat == "The capital of France is Paris."
    assert response == "The capital of France is Paris."
    assert out.count("Paris") == 3  # and the completion's continuation


def test_openai_embeddings_snippet(frontend, smollm2_dir, tmp_path):
    out = _run("openai-embeddings", frontend.base_url, smollm2_dir, tmp_path)
    hidden = json.loads((smollm2_dir / "config.json").read_text())["hidden_size"]
    assert out.split() == ["2", str(hidden)]


def test_langchain_snippet(frontend, smollm2_dir, tmp_path):
    out = _run("langchain", frontend.base_url, smollm2_dir, tmp_path)
    assert out.strip() == "The capital of France is Paris."


def test_lm_eval_snippet(frontend, smollm2_dir, tmp_path):
    out = _run("lm-eval", frontend.base_url, smollm2_dir, tmp_path)
    # lm-eval's results tables: one row per task and metric.
    for task, metric in [
        ("llmserve_mc", "acc"),
        ("llmserve_gen", "exact_match"),
        ("llmserve_chat", "acc"),
    ]:
        assert re.search(rf"\|{task}\s*\|.*\|{metric}\s*\|", out), out


def test_guidellm_snippet(frontend, smollm2_dir, tmp_path):
    out = _run("guidellm", frontend.base_url, smollm2_dir, tmp_path)
    assert "Benchmarking complete" in out
    # The summary row: 8 requests completed, none incomplete or errored.
    row = next(line for line in out.splitlines() if line.startswith("| concurrent"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[6:9] == ["8", "0", "0"], row
    # Its report, written to the working directory by default, says the same.
    (bench,) = json.loads((tmp_path / "benchmarks.json").read_text())["benchmarks"]
    assert bench["scheduler_state"]["successful_requests"] == 8
    assert bench["scheduler_state"]["errored_requests"] == 0
