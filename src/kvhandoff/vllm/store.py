"""The K/V store between vLLM instances: entries in Valkey (or Redis), one per (tenant, model, full-block prefix).

Key: ``kvhandoff:<tenant>:<model identity>:<prefix hash>`` — the tenant percent-quoted, the model identity a hash of
the model's kvhandoff fingerprint (`model_identity`), the prefix hash a SHA-256 of the prefix's token ids
(`prefix_hashes`). Value: ``MAGIC``, a 4-byte big-endian header length, the header (JSON: format, model identity
and name, tenant, prefix hash, token count, dtype, shape [layers, 2, tokens, kv_heads, head_dim], payload size,
SHA-256 of the payload), then the payload: the rows as one contiguous tensor (K and V of every layer, keys after
RoPE). `decode_entry` refuses an entry that does not say exactly what its key promised (`EntryRefused`, with the
reason): a truncated or corrupt entry, another model's, another tenant's, another prefix's.

Capacity is the server's: run it with ``maxmemory`` and an LRU policy (``allkeys-lru``), as `local_store` does.
The client (`KVStore`) imports ``redis`` when built, so this module imports without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import torch

from kvhandoff.errors import ConfigError
from kvhandoff.files import sha256_json
from kvhandoff.model.geometry import PAIRING_KEYS
from kvhandoff.vllm.launch import free_port, stop_process

MAGIC = b"KVHOFF01"
FORMAT = 1
KEY_PREFIX = "kvhandoff"
#: the fingerprint entries that name a model in the store: those a mapper checks, but the tokenizer's hash (the
#: family shares one tokenizer, and a fingerprint taken without it records none)
IDENTITY_KEYS = tuple(key for key in PAIRING_KEYS if key != "tokenizer_hash")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EntryRefused(ValueError):
    """A store entry that must not be loaded; the message says why."""


def model_identity(fingerprint: dict) -> str:
    """The store's name for a model: a hash of its kvhandoff fingerprint's identity entries (`IDENTITY_KEYS`)."""
    return sha256_json({key: fingerprint.get(key) for key in IDENTITY_KEYS})[:32]


def prefix_hashes(token_ids: list[int], block_size: int, blocks: int | None = None) -> list[str]:
    """The hashes of the first 1, 2, … full blocks of ``token_ids`` (at most ``blocks`` of them): SHA-256 of the
    prefix's ids as little-endian int64, computed incrementally."""
    count = len(token_ids) // block_size if blocks is None else min(blocks, len(token_ids) // block_size)
    digest = hashlib.sha256()
    hashes = []
    for index in range(count):
        block = token_ids[index * block_size:(index + 1) * block_size]
        digest.update(struct.pack(f"<{len(block)}q", *block))
        hashes.append(digest.copy().hexdigest()[:40])
    return hashes


def opening_prefix(token_ids: list[int]) -> str:
    """The prefix name of an opening entry: a model's own K/V of a prompt's first tokens (its exact prefix), what a
    mapped load puts in place of the mapped ones there."""
    return f"opening{len(token_ids)}-{prefix_hashes(token_ids, len(token_ids))[0]}"


def entry_key(tenant: str, identity: str, prefix: str) -> str:
    return f"{KEY_PREFIX}:{quote(tenant, safe='')}:{identity}:{prefix}"


def parse_key(key: str) -> tuple[str, str, str]:
    """(quoted tenant, identity, prefix hash) of an entry key."""
    prefix, tenant, identity, digest = key.split(":")
    if prefix != KEY_PREFIX:
        raise ValueError(f"not a kvhandoff store key: {key!r}")
    return tenant, identity, digest


@dataclass(frozen=True)
class Expected:
    """What the key an entry was read under promises about it."""

    identity: str
    tenant: str
    prefix: str
    tokens: int
    geometry: tuple[int, int, int] | None = None  # (layers, kv_heads, head_dim), when known


def encode_entry(rows: torch.Tensor, *, identity: str, model_name: str, tenant: str, prefix: str) -> bytes:
    """The stored form of ``rows`` [layers, 2, tokens, kv_heads, head_dim] (K then V per layer)."""
    rows = rows.contiguous()
    dtype = str(rows.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"cannot store K/V of dtype {dtype}")
    payload = rows.view(torch.uint8).numpy().tobytes() if rows.numel() else b""
    header = {"format": FORMAT, "model": identity, "model_name": model_name, "tenant": tenant, "prefix": prefix,
              "tokens": int(rows.shape[2]), "dtype": dtype, "shape": list(rows.shape),
              "payload_bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    text = json.dumps(header, sort_keys=True).encode()
    return MAGIC + struct.pack(">I", len(text)) + text + payload


def decode_header(value: bytes) -> tuple[dict, int]:
    """(header, payload offset) of a stored entry; EntryRefused when it is not one."""
    if value[:len(MAGIC)] != MAGIC:
        raise EntryRefused("not a kvhandoff entry (bad magic)")
    start = len(MAGIC) + 4
    if len(value) < start:
        raise EntryRefused(f"truncated entry ({len(value)} bytes, no header)")
    (size,) = struct.unpack(">I", value[len(MAGIC):start])
    if len(value) < start + size:
        raise EntryRefused(f"truncated entry ({len(value)} bytes, header of {size} bytes cut)")
    try:
        header = json.loads(value[start:start + size])
    except ValueError as error:
        raise EntryRefused(f"unreadable header ({error})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise EntryRefused(f"unknown entry format {header.get('format') if isinstance(header, dict) else header!r}")
    return header, start + size


def decode_entry(value: bytes | None, expected: Expected) -> torch.Tensor:
    """The rows [layers, 2, tokens, kv_heads, head_dim] of a stored entry, after checking that it is whole and is
    exactly what ``expected`` says; EntryRefused naming the first thing that is not."""
    if value is None:
        raise EntryRefused("no entry (evicted or removed)")
    header, offset = decode_header(value)
    checks = (("model", expected.identity, "another model's entry"), ("tenant", expected.tenant,
              "another tenant's entry"), ("prefix", expected.prefix, "another prefix's entry"),
              ("tokens", expected.tokens, "another length"))
    for field, want, what in checks:
        if header.get(field) != want:
            raise EntryRefused(f"{what}: header {field}={header.get(field)!r}, expected {want!r}")
    dtype = _DTYPES.get(header.get("dtype"))
    shape = header.get("shape")
    if dtype is None or not isinstance(shape, list) or len(shape) != 5 or shape[1] != 2 or shape[2] != expected.tokens:
        raise EntryRefused(f"bad dtype/shape in header: {header.get('dtype')!r} {shape!r}")
    if expected.geometry is not None and (shape[0], shape[3], shape[4]) != tuple(expected.geometry):
        raise EntryRefused(f"rows of {shape[0]} layers × {shape[3]} KV heads × head dim {shape[4]}, expected "
                           f"{expected.geometry[0]} × {expected.geometry[1]} × {expected.geometry[2]}")
    payload = value[offset:]
    size = dtype.itemsize
    for dim in shape:
        size *= dim
    if len(payload) != header.get("payload_bytes") or len(payload) != size:
        raise EntryRefused(f"truncated or padded payload: {len(payload)} bytes, header says "
                           f"{header.get('payload_bytes')}, shape needs {size}")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise EntryRefused("payload checksum mismatch (corrupt entry)")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)


class KVStore:
    """The entries in a Valkey/Redis server at ``url`` (``redis://host:port/db``). Store errors are the caller's
    to treat as a miss."""

    def __init__(self, url: str, ttl_s: int | None = None, timeout_s: float = 5.0):
        import redis

        self.url = url
        self.ttl_s = ttl_s
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def exists(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(found) for found in pipe.execute()]

    def get(self, key: str) -> bytes | None:
        return self._client.get(key)

    def put(self, key: str, value: bytes) -> None:
        self._client.set(key, value, ex=self.ttl_s)

    def keys(self, pattern: str = f"{KEY_PREFIX}:*") -> list[str]:
        return sorted(key.decode() for key in self._client.scan_iter(match=pattern))

    def delete(self, key: str) -> None:
        self._client.delete(key)


def store_server() -> str:
    """The path of a Valkey (else Redis) server program, or a ConfigError naming the fix."""
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found is None:
        raise ConfigError("no valkey-server or redis-server on PATH: run `bash scripts/setup.sh` (it installs one), "
                          "or `apt-get install valkey-server` (Debian), or point store_url at a running one")
    return found


@contextlib.contextmanager
def local_store(folder: Path, max_memory: str = "1gb", timeout_s: float = 20.0) -> Iterator[str]:
    """A Valkey/Redis server on a free loopback port for the life of the block, its files in ``folder``, nothing
    persisted, the least recently used entries evicted past ``max_memory``; yields its URL."""
    port = free_port()
    process = subprocess.Popen(
        [store_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", max_memory, "--maxmemory-policy", "allkeys-lru", "--dir", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while not _answers_ping(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise ConfigError(f"{store_server()} did not start on 127.0.0.1:{port} within {timeout_s:g} s")
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_process(process, 10.0)


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(16).startswith(b"+PONG")
    except OSError:
        return False
