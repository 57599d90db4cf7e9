"""llguidance vs xgrammar on this machine: grammar compile time for five real-world JSON
schemas and the per-token mask time along a valid output, with the demo model's tokenizer.

    .venv/bin/python benchmarks/bench_grammar_libs.py [--model-dir DIR] [--repeat 5]

Compile: a fresh compiler/matcher per run (no cache), up to the first mask (llguidance compiles
lazily). Mask: one mask per token while a valid JSON document (the schema's example) is fed
token by token. Medians in ms. xgrammar needs torch (it may run in the executor only); the
scheduler can use only llguidance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMAS: dict[str, tuple[dict, dict]] = {
    "tool_call_weather": (
        {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City and country"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["location", "unit"],
            "additionalProperties": False,
        },
        {"location": "Paris, France", "unit": "celsius", "days": 3},
    ),
    "github_issue": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 120},
                "body": {"type": "string"},
                "labels": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
                "assignees": {"type": "array", "items": {"type": "string"}},
                "milestone": {"type": ["integer", "null"]},
                "state": {"enum": ["open", "closed"]},
            },
            "required": ["title", "body", "labels", "state"],
        },
        {"title": "Crash on start", "body": "It fails.", "labels": ["bug"], "state": "open"},
    ),
    "product": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
                "name": {"type": "string"},
                "price": {"type": "number", "minimum": 0},
                "currency": {"enum": ["USD", "EUR", "GBP"]},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                "dimensions": {
                    "type": "object",
                    "properties": {
                        "length": {"type": "number"},
                        "width": {"type": "number"},
                        "height": {"type": "number"},
                    },
                    "required": ["length", "width", "height"],
                },
            },
            "required": ["id", "name", "price", "currency"],
        },
        {"id": "ABC-123456", "name": "Desk", "price": 199.5, "currency": "EUR",
         "dimensions": {"length": 1.2, "width": 0.6, "height": 0.75}},
    ),
    "person_address": (
        {
            "$defs": {
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        "country": {"type": "string", "minLength": 2, "maxLength": 2},
                    },
                    "required": ["street", "city", "country"],
                }
            },
            "type": "object",
            "properties": {
                "first_name": {"type": "string"},
                "last_name": {"type": "string"},
                "email": {"type": "string", "format": "email"},
                "age": {"type": "integer", "minimum": 0},
                "home": {"$ref": "#/$defs/address"},
                "work": {"$ref": "#/$defs/address"},
            },
            "required": ["first_name", "last_name", "home"],
        },
        {"first_name": "Ada", "last_name": "Lovelace", "email": "ada@example.com",
         "home": {"street": "1 Main St", "city": "London", "zip": "12345", "country": "GB"}},
    ),
    "calendar_event": (
        {
            "type": "object",
            "properties": {
                "summary": {"type": "string"},
                "start": {"type": "string", "format": "date-time"},
                "end": {"type": "string", "format": "date-time"},
                "attendees": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "email": {"type": "string"},
                            "optional": {"type": "boolean"},
                            "response": {"enum": ["accepted", "declined", "tentative"]},
                        },
                        "required": ["email"],
                    },
                },
                "recurrence": {"anyOf": [{"type": "null"}, {"type": "string"}]},
                "reminders": {"type": "array", "items": {"type": "integer"}, "maxItems": 5},
            },
            "required": ["summary", "start", "end"],
        },
        {"summary": "Standup", "start": "2026-11-25T09:00:00Z", "end": "2026-11-25T09:15:00Z",
         "attendees": [{"email": "a@b.c", "response": "accepted"}], "reminders": [10]},
    ),
}  # fmt: skip


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def bench_llguidance(tok, vocab: int, eos: int, repeat: int) -> dict[str, tuple[float, float]]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as llnp

    ll_tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
    opts = {"whitespace_flexible": False}
    out = {}
    for name, (schema, example) in SCHEMAS.items():
        compile_s = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=opts
            )
            m = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
            m.compute_bitmask()
            compile_s.append(time.perf_counter() - t0)
            assert not m.is_error(), m.get_error()
        # Compact llguidance JSON has no whitespace at all.
        tokens = tok.encode(json.dumps(example, separators=(",", ":")), add_special_tokens=False)
        m = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
        mask = llnp.allocate_token_bitmask(1, vocab)
        mask_s = []
        for t in tokens:
            t0 = time.perf_counter()
            llnp.fill_next_token_bitmask(m, mask, 0)
            mask_s.append(time.perf_counter() - t0)
            assert m.consume_token(t), (name, m.get_error())
        out[name] = (_median_ms(compile_s), _median_ms(mask_s))
    return out


def bench_xgrammar(tok, vocab: int, repeat: int) -> dict[str, tuple[float, float]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    out = {}
    for name, (schema, example) in SCHEMAS.items():
        compile_s = []
        for _ in range(repeat):
            compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            t0 = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            m = xgr.GrammarMatcher(compiled)
            mask = xgr.allocate_token_bitmask(1, vocab)
            m.fill_next_token_bitmask(mask)
            compile_s.append(time.perf_counter() - t0)
        # xgrammar's compact separators are ", " and ": " like json.dumps' defaults.
        tokens = tok.encode(json.dumps(example), add_special_tokens=False)
        m = xgr.GrammarMatcher(compiled)
        mask_s = []
        for t in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            mask_s.append(time.perf_counter() - t0)
            assert m.accept_token(t), name
        out[name] = (_median_ms(compile_s), _median_ms(mask_s))
    return out


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split()
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln), "?"
    )
    keep = sorted(f for f in flags if f.startswith(("avx", "amx", "sse4", "fma", "bmi")))
    return f"{model}; {' '.join(keep)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=None, help="default: the demo model")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model_dir = args.model_dir
    if model_dir is None:
        from executor_svc.demo.demo_model import ensure_demo_model

        model_dir = ensure_demo_model(Path("/tmp/llmserve-bench"), size="demo", seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    print(f"cpu: {cpu_flags()}")
    print(f"tokenizer: {model_dir} (vocab {vocab})")
    ll = bench_llguidance(tok, vocab, tok.eos_token_id, args.repeat)
    xg = bench_xgrammar(tok, vocab, args.repeat)
    print(
        "| schema | llguidance compile ms | xgrammar compile ms | llguidance mask ms/token | xgrammar mask ms/token |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in SCHEMAS:
        print(f"| {name} | {ll[name][0]} | {xg[name][0]} | {ll[name][1]} | {xg[name][1]} |")


if __name__ == "__main__":
    main()
