"""`LLM`: vLLM's offline API on top of llmserve.

`LLM(model="demo")` (or a checkpoint directory) starts a private stack as a child process: the
local launcher (`python -m scheduler_svc.local.launch`, what `make run` runs), which starts an
executor on the model and runs a scheduler with its own embedded Redis, each on a port the OS
picks, with their data in a temporary directory. `LLM(address="host:port")` uses a running
scheduler instead. `generate()` and `chat()` return RequestOutputs in prompt order. `close()`,
leaving a `with` block or the interpreter exiting stops whatever was started.

The client never imports the services: it runs their launcher as a command, exactly as an
operator would.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import client.envs as envs
from client.features import OfflineFeatures
from client.outputs import LoraAdapterInfo, RequestOutput
from client.params import SamplingParams
from client.prompts import ChatPrompt
from client.sync_client import LLMClient

__all__ = ["LLM"]


def _wait_port(path: Path, proc: subprocess.Popen, timeout: float, what: str, log: Path) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text().strip() if path.exists() else ""
        if text:
            return int(text)
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"the {what} exited with code {proc.returncode}:\n{tail}")
        time.sleep(0.05)
    raise TimeoutError(f"the {what} did not start within {timeout:.0f}s (log: {log})")


def _stop(procs: list[subprocess.Popen], workdir: Path | None) -> None:
    """The launcher stops its scheduler first (it drains and stops its Redis), then its
    executor; then the files go."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                # The scheduler's stop ends within 25 s (its watchdog), the executor's within 15.
                proc.wait(timeout=45)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)


class LLM(OfflineFeatures):
    def __init__(
        self,
        model: str = "demo",
        *,
        address: str | None = None,
        executor_args: Sequence[str] = (),
        scheduler_args: Sequence[str] = (),
        startup_timeout: float = 600.0,
        log_level: str = "warning",
        speculative_config: dict | None = None,
    ) -> None:
        """``speculative_config``: the scheduler's --speculative-config as a dict, e.g.
        {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} (a draft's
        checkpoint is also handed to the executor as --speculative-model)."""
        self._procs: list[subprocess.Popen] = []
        self._finalizer = None
        if address is None:
            launch_args = [
                *(f"--executor-arg={a}" for a in executor_args),
                *(f"--scheduler-arg={a}" for a in scheduler_args),
            ]
            if speculative_config is not None:
                # The launcher hands a draft_model's checkpoint to the executor as well.
                launch_args += ["--speculative-config", json.dumps(speculative_config)]
            address = self._start_stack(model, launch_args, startup_timeout, log_level)
        self.address = address
        self._client = LLMClient(address, timeout=60)
        try:
            self._client.wait_ready(startup_timeout)
        except BaseException:
            self.close()
            raise
        self.model = self._client.server_info().model

    def _start_stack(
        self, model: str, launch_args: list[str], timeout: float, log_level: str
    ) -> str:
        workdir = Path(tempfile.mkdtemp(prefix="llmserve-llm-"))
        env = envs.child_environment({"HF_HUB_OFFLINE": "1"})
        self._finalizer = weakref.finalize(self, _stop, self._procs, workdir)
        log = workdir / "llmserve.log"
        port_file = workdir / "scheduler.port"
        with open(log, "ab") as out:
            launcher = subprocess.Popen(
                [
                    sys.executable, "-m", "scheduler_svc.local.launch", "--model", model,
                    "--executor-port", "0", "--scheduler-port", "0", "--frontend-port", "0",
                    "--redis-dir", str(workdir / "redis"), "--log-level", log_level,
                    f"--scheduler-arg=--port-file={port_file}", *launch_args,
                ],  # fmt: skip
                env=env, stdout=out, stderr=out,
            )  # fmt: skip
        self._procs.append(launcher)
        sport = _wait_port(port_file, launcher, timeout, "local stack", log)
        return f"127.0.0.1:{sport}"

    # ---- vLLM's offline API ------------------------------------------------------------------

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: int | Sequence[int] = 0,
        lora_adapter: str = "",
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order (strings, token-id lists or dicts as
        vLLM takes them), with a progress bar of the batch's token rates. `lora_adapter`: a
        loaded LoRA adapter's name (``load_lora_adapter``, or the ``lora_modules`` the server
        was started with); "" = the base model."""
        return self._client.generate(
            prompts,
            sampling_params,
            use_tqdm=use_tqdm,
            priority=priority,
            lora_adapter=lora_adapter,
        )

    def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        return self._client.load_lora_adapter(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        self._client.unload_lora_adapter(name)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several (a list of lists); the model's chat
        template renders each, handed `tools` (OpenAI tool objects) as vLLM's LLM.chat does."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            ChatPrompt([dict(m) for m in conv], add_generation_prompt, tools)  # type: ignore[arg-type]
            for conv in conversations
        ]
        return self._client.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ---- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        client = getattr(self, "_client", None)
        if client is not None:
            client.close()
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
