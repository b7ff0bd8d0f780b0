"""A tiered KV store (LMCache-style): device blocks -> CPU memory -> disk files.

The device pool holds only what running requests need plus the prefix cache's idle blocks; a
store behind it keeps far more KV, in cheaper memory, keyed by *chunk hashes*:

- a **chunk** is ``chunk_tokens`` consecutive tokens of a sequence, aligned from its start (a
  whole number of blocks). Its key hashes the previous chunk's key with its own tokens (and the
  model's fingerprint), so a key names the chunk *and everything before it*: the same rule as
  the hashed prefix cache, stable across processes (blake2b, not Python's salted ``hash``).
- **save**: when a sequence's computed tokens complete a chunk, its blocks (scattered in the
  pool) are gathered into one staging tensor ``[2, n_layers, chunk_tokens, Hkv, hd]`` (K, V) and
  put in the CPU tier; the disk tier gets a copy written by a background thread (write-through,
  so a second process finds it).
- **load**: admitting a request whose prompt continues past the device's cached prefix, the
  scheduler asks the store how many more leading chunks it holds (an index lookup), and fetches
  them once the request is admitted (a disk read is verified and promoted to the CPU tier); the
  runner scatters the staging tensor into the request's new blocks before the forward pass, or
  layer by layer while the forward runs (:class:`LayerwiseLoad`), so loading layer l+1 overlaps
  computing layer l.

Each tier has a byte cap and evicts least recently used entries. A disk entry is one file: a
magic line, a JSON header (key, shape, dtype, payload bytes, CRC-32 of the payload) and the raw
payload; it is written to a temporary name, flushed, fsynced and renamed into place, so a crash
mid-write leaves no file under an entry's name. A file that is truncated, corrupted or gone when
read is a miss (and deleted): the engine recomputes those tokens instead of serving wrong KV. A
full or failing disk drops that write (counted) and the store carries on from memory.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import queue
import shutil
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"MINILLM-KV1\n"
SUFFIX = ".kv"


@dataclass(frozen=True)
class OffloadConfig:
    """``cpu_bytes``: CPU tier cap (0: no CPU tier; disk hits are read on demand). ``disk_dir``:
    folder of the disk tier (None: no disk tier), capped at ``disk_bytes``. ``chunk_tokens``:
    tokens per stored chunk (a multiple of the engine's block size). ``layerwise``: load layer
    by layer during the forward pass (else all layers before it)."""

    cpu_bytes: int = 1 << 30
    disk_dir: str | None = None
    disk_bytes: int = 4 << 30
    chunk_tokens: int = 256
    layerwise: bool = True

    def __post_init__(self) -> None:
        for name in ("cpu_bytes", "disk_bytes", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"kv_offload.{name} must be an int >= 0, got {value!r}")
        if self.chunk_tokens < 1:
            raise ValueError(f"kv_offload.chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.cpu_bytes > physical_memory():
            raise ValueError(f"kv_offload.cpu_bytes ({self.cpu_bytes}) is larger than this "
                             f"machine's memory ({physical_memory()} bytes)")
        if self.disk_dir is None and self.cpu_bytes == 0:
            raise ValueError("kv_offload stores nothing: cpu_bytes is 0 and disk_dir is None")
        if self.disk_dir is not None and self.disk_bytes == 0:
            raise ValueError("kv_offload.disk_bytes must be > 0 when disk_dir is set")

    @classmethod
    def from_options(cls, options: OffloadConfig | dict) -> OffloadConfig:
        """An OffloadConfig from itself or a dict of its fields (unknown keys: ValueError)."""
        if isinstance(options, cls):
            return options
        if not isinstance(options, dict):
            raise ValueError(f"kv_offload must be a dict or OffloadConfig, got {options!r}")
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"kv_offload: unknown option(s) {sorted(unknown)}; known: "
                             f"{sorted(cls.__dataclass_fields__)}")
        return cls(**options)


def physical_memory() -> int:
    """Bytes of RAM on this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def model_fingerprint(model: torch.nn.Module) -> bytes:
    """Bytes that differ between models (config, dtype, a few weights): part of every key, so
    one model never reads another's KV from a shared disk folder."""
    h = hashlib.blake2b(repr(getattr(model, "cfg", None)).encode(), digest_size=16)
    params = list(model.parameters())
    for p in (params[0], params[len(params) // 2], params[-1]):
        h.update(str(p.dtype).encode())
        h.update(p.detach().flatten()[:64].float().cpu().numpy().tobytes())
    return h.digest()


def chunk_keys(token_ids: Sequence[int], chunk_tokens: int, namespace: bytes = b"") -> list[str]:
    """The key of every whole chunk of ``token_ids``, in order; each covers all before it."""
    keys, parent = [], hashlib.blake2b(namespace, digest_size=16).digest()
    for i in range(len(token_ids) // chunk_tokens):
        chunk = torch.tensor(token_ids[i * chunk_tokens:(i + 1) * chunk_tokens], dtype=torch.int64)
        parent = hashlib.blake2b(parent + chunk.numpy().tobytes(), digest_size=16).digest()
        keys.append(parent.hex())
    return keys


@dataclass
class TierStats:
    """Traffic of one tier: entries and bytes in (written to it) and out (read from it)."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    corrupt: int = 0           # disk: entries that failed their checks when read
    write_errors: int = 0      # disk: writes dropped (full disk, I/O error)


class MemoryTier:
    """CPU tensors by key, at most ``capacity`` bytes, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.used = 0
        self.stats = TierStats()

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str) -> torch.Tensor | None:
        kv = self.entries.get(key)
        if kv is None:
            self.stats.misses += 1
            return None
        self.entries.move_to_end(key)
        self.stats.hits += 1
        self.stats.bytes_out += _nbytes(kv)
        return kv

    def put(self, key: str, kv: torch.Tensor) -> bool:
        """Keep ``kv`` (evicting LRU entries for room); False if it can never fit."""
        size = _nbytes(kv)
        if key in self.entries or size > self.capacity:
            return key in self.entries
        while self.used + size > self.capacity:
            _, old = self.entries.popitem(last=False)
            self.used -= _nbytes(old)
            self.stats.evictions += 1
        self.entries[key] = kv
        self.used += size
        self.stats.puts += 1
        self.stats.bytes_in += size
        return True


class DiskTier:
    """One file per entry in ``directory``, at most ``capacity`` bytes of files, LRU evicted.

    Entries already in the folder (another process's) are indexed at start, oldest access first;
    leftover temporary files of interrupted writes are removed. Writes run on a background
    thread (``flush`` waits for them); reads verify size and checksum."""

    def __init__(self, directory: str | os.PathLike, capacity: int) -> None:
        self.dir = Path(directory)
        self.capacity = capacity
        self.stats = TierStats()
        self._check_writable()
        self.index: OrderedDict[str, int] = OrderedDict()     # key -> file bytes, LRU order
        self._lock = threading.Lock()
        self._pending: dict[str, torch.Tensor] = {}
        self._queue: queue.Queue = queue.Queue()
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, daemon=True)
        self._writer.start()
        atexit.register(_flush_if_alive, weakref.ref(self))

    def _check_writable(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}-{threading.get_ident()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"kv_offload.disk_dir {str(self.dir)!r} is not a writable "
                             f"directory: {e}") from e
        total = shutil.disk_usage(self.dir).total
        if self.capacity > total:
            raise ValueError(f"kv_offload.disk_bytes ({self.capacity}) is larger than the disk "
                             f"holding {str(self.dir)!r} ({total} bytes)")

    def _scan(self) -> None:
        files = []
        for path in self.dir.iterdir():
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)          # an interrupted write: never an entry
            elif path.suffix == SUFFIX:
                st = path.stat()
                files.append((st.st_atime, path.stem, st.st_size))
        for _, key, size in sorted(files):
            self.index[key] = size
        self._evict_for(0)

    @property
    def used(self) -> int:
        return sum(self.index.values())

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self.index or key in self._pending

    def get(self, key: str) -> torch.Tensor | None:
        """The entry's tensor, or None if it is missing or fails its checks (then deleted)."""
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            self.stats.hits += 1
            return pending
        try:
            raw = self._path(key).read_bytes()
            kv = decode_entry(raw, key)
        except (OSError, ValueError):
            kv = None
        with self._lock:
            if kv is None:
                self.stats.misses += 1
                if self.index.pop(key, None) is not None:
                    self.stats.corrupt += 1
                    self._path(key).unlink(missing_ok=True)
                return None
            self.index[key] = len(raw)
            self.index.move_to_end(key)
        os.utime(self._path(key))                 # the access time orders a restart's LRU
        self.stats.hits += 1
        self.stats.bytes_out += len(raw)
        return kv

    def put(self, key: str, kv: torch.Tensor) -> None:
        """Queue ``kv`` for writing (nothing if the key is stored or queued already)."""
        with self._lock:
            if key in self.index or key in self._pending:
                return
            self._pending[key] = kv
        self._queue.put(key)

    def flush(self) -> None:
        """Wait until every queued write is on disk (or dropped)."""
        self._queue.join()

    def _write_loop(self) -> None:
        """The writer thread: it outlives a failed write (counted in ``write_errors``), or
        every later write would wait forever, and so would :meth:`flush` and the exit."""
        while True:
            key = self._queue.get()
            try:
                self._write(key, self._pending[key])
            except Exception:                     # noqa: BLE001 - a dropped write, not a hang
                self.stats.write_errors += 1
            finally:
                with self._lock:
                    self._pending.pop(key, None)
                self._queue.task_done()

    def _write(self, key: str, kv: torch.Tensor) -> None:
        data = encode_entry(kv, key)
        with self._lock:
            if len(data) > self.capacity:
                self.stats.write_errors += 1
                return
            self._evict_for(len(data))
        tmp = self.dir / f".tmp-{key}-{os.getpid()}"
        try:
            write_atomic(tmp, self._path(key), data)
        except OSError:
            tmp.unlink(missing_ok=True)
            self.stats.write_errors += 1          # a full or failing disk: keep serving
            return
        with self._lock:
            self.index[key] = len(data)
        self.stats.puts += 1
        self.stats.bytes_in += len(data)

    def _evict_for(self, size: int) -> None:
        """Delete least recently used files until ``size`` more bytes fit (lock held)."""
        used = self.used
        while self.index and used + size > self.capacity:
            key, old = self.index.popitem(last=False)
            self._path(key).unlink(missing_ok=True)
            used -= old
            self.stats.evictions += 1


def _flush_if_alive(ref: weakref.ref) -> None:
    tier = ref()
    if tier is not None:
        tier.flush()


def write_atomic(tmp: Path, final: Path, data: bytes) -> None:
    """Write ``data`` to ``tmp``, fsync it, and rename it to ``final`` (atomic on POSIX)."""
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)


def encode_entry(kv: torch.Tensor, key: str) -> bytes:
    """A disk entry: magic, 8-byte header length, JSON header, raw payload."""
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    header = json.dumps({"key": key, "shape": list(kv.shape), "dtype": str(kv.dtype),
                         "nbytes": len(payload), "crc32": f"{zlib.crc32(payload):08x}"}).encode()
    return MAGIC + len(header).to_bytes(8, "little") + header + payload


def decode_entry(raw: bytes, key: str) -> torch.Tensor:
    """The tensor of a disk entry; ValueError when anything about it is wrong."""
    if not raw.startswith(MAGIC):
        raise ValueError("not a KV entry")
    start = len(MAGIC) + 8
    length = int.from_bytes(raw[len(MAGIC):start], "little")
    try:
        header = json.loads(raw[start:start + length])
        dtype = getattr(torch, header["dtype"].removeprefix("torch."))
    except (ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"bad header: {e}") from e
    payload = raw[start + length:]
    if header.get("key") != key or len(payload) != header["nbytes"]:
        raise ValueError("wrong key or truncated payload")
    if f"{zlib.crc32(payload):08x}" != header["crc32"]:
        raise ValueError("checksum mismatch")
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(dtype).reshape(header["shape"])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class KVLoad:
    """Stored KV for a sequence's blocks ``first .. first + len(blocks)``: ``kv`` is one staging
    tensor [2, n_layers, len(blocks) * block_size, Hkv, hd] (K then V)."""

    seq_id: int
    first: int
    kv: torch.Tensor


@dataclass
class LoadTiming:
    """Seconds spent copying stored KV into the pool, and the part the forward waited for."""

    loads: int = 0
    load_seconds: float = 0.0
    exposed_seconds: float = 0.0

    @property
    def hidden_seconds(self) -> float:
        return max(0.0, self.load_seconds - self.exposed_seconds)


class TieredKVStore:
    """The CPU and disk tiers behind one engine's device pool (see the module docstring)."""

    def __init__(self, config: OffloadConfig, namespace: bytes, block_size: int,
                 token_bytes: int = 0) -> None:
        """``token_bytes``: KV bytes of one token (all layers, K and V); a tier too small for
        one chunk of them is refused."""
        if config.chunk_tokens % block_size:
            raise ValueError(f"kv_offload.chunk_tokens ({config.chunk_tokens}) must be a "
                             f"multiple of block_size ({block_size})")
        chunk = token_bytes * config.chunk_tokens
        for name in ("cpu_bytes", "disk_bytes"):
            cap = getattr(config, name)
            if 0 < cap < chunk and (name == "cpu_bytes" or config.disk_dir):
                raise ValueError(f"kv_offload.{name} ({cap}) holds no chunk of {chunk} bytes: "
                                 f"use 0 (no such tier) or at least {chunk}")
        self.config, self.namespace, self.block_size = config, namespace, block_size
        self.cpu = MemoryTier(config.cpu_bytes)
        self.disk = DiskTier(config.disk_dir, config.disk_bytes) if config.disk_dir else None
        self.timing = LoadTiming()
        self.saved: dict[int, int] = {}     # seq id -> its leading chunks known to be stored
        self.device_in = self.device_out = 0   # bytes saved from / loaded into the device pool
        self.tokens_loaded = 0                 # prompt tokens whose KV came from the store

    @property
    def blocks_per_chunk(self) -> int:
        return self.config.chunk_tokens // self.block_size

    def keys(self, token_ids: Sequence[int]) -> list[str]:
        return chunk_keys(token_ids, self.config.chunk_tokens, self.namespace)

    def __contains__(self, key: str) -> bool:
        return key in self.cpu or (self.disk is not None and key in self.disk)

    def stored_blocks(self, token_ids: Sequence[int], limit: int) -> int:
        """Leading blocks of ``token_ids`` (at most ``limit``) whose chunks are all stored (an
        index lookup, nothing read)."""
        n = 0
        for key in self.keys(token_ids[:-(-limit // self.blocks_per_chunk)
                                       * self.config.chunk_tokens]):
            if key not in self:
                break
            n += 1
        return min(limit, n * self.blocks_per_chunk)

    def get(self, key: str) -> torch.Tensor | None:
        """A chunk's KV from the CPU tier, else from disk (verified, then kept in CPU)."""
        kv = self.cpu.get(key)
        if kv is None and self.disk is not None:
            kv = self.disk.get(key)
            if kv is not None:
                self.cpu.put(key, kv)
        return kv

    def fetch(self, seq_id: int, token_ids: Sequence[int], first: int, last: int) -> KVLoad | None:
        """Stored KV of blocks [first, last) gathered into one staging tensor; it may cover
        fewer blocks than asked (a chunk missing or corrupt on disk), None if none."""
        bpc, bs = self.blocks_per_chunk, self.block_size
        keys = self.keys(token_ids[:-(-last // bpc) * self.config.chunk_tokens])
        parts, block = [], first
        while block < last:
            kv = self.get(keys[block // bpc])
            if kv is None:
                break
            stop = min(last, (block // bpc + 1) * bpc)
            lo = (block - block // bpc * bpc) * bs
            parts.append(kv[:, :, lo:lo + (stop - block) * bs])
            block = stop
        if not parts:
            return None
        staged = torch.cat(parts, dim=2)
        self.device_out += _nbytes(staged)
        self.tokens_loaded += staged.shape[2]
        return KVLoad(seq_id, first, staged)

    def save(self, seq_id: int, token_ids: Sequence[int], num_computed: int, table: list[int],
             gather) -> int:
        """Store the sequence's chunks that ``num_computed`` tokens complete and the store lacks;
        ``gather(blocks)`` -> [2, L, len(blocks) * block_size, Hkv, hd] reads the pool. Returns
        the chunks written."""
        done = min(num_computed // self.config.chunk_tokens, len(table) // self.blocks_per_chunk)
        start = self.saved.get(seq_id, 0)
        if done <= start:
            return 0
        keys, bpc, written = self.keys(token_ids[:done * self.config.chunk_tokens]), \
            self.blocks_per_chunk, 0
        for c in range(start, done):
            if keys[c] in self:
                continue
            kv = gather(table[c * bpc:(c + 1) * bpc])
            self.device_in += _nbytes(kv)
            self.cpu.put(keys[c], kv)
            if self.disk is not None:
                self.disk.put(keys[c], kv)
            written += 1
        self.saved[seq_id] = done
        return written

    def forget(self, seq_id: int) -> None:
        self.saved.pop(seq_id, None)

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def stats(self) -> dict:
        """Tier traffic so far (bytes), hits and misses, load timing."""
        out = {"device_to_cpu_bytes": self.device_in, "store_to_device_bytes": self.device_out,
               "tokens_loaded": self.tokens_loaded,
               "cpu": vars(self.cpu.stats) | {"used_bytes": self.cpu.used},
               "load_seconds": self.timing.load_seconds,
               "exposed_seconds": self.timing.exposed_seconds,
               "hidden_seconds": self.timing.hidden_seconds, "loads": self.timing.loads}
        if self.disk is not None:
            out["disk"] = vars(self.disk.stats) | {"used_bytes": self.disk.used}
        return out


class LayerwiseLoad:
    """Scatter staged KV into the pool layer by layer on a background thread (a side stream on
    CUDA) while the forward pass runs; the runner calls :meth:`wait` before each layer (through
    its KV connector), and the time it waits is the load's *exposed* time. ``loads``: (block
    ids tensor, :class:`KVLoad`) pairs."""

    def __init__(self, pool, loads: list[tuple[torch.Tensor, KVLoad]], n_layers: int,
                 timing: LoadTiming) -> None:
        self.pool, self.loads, self.timing = pool, loads, timing
        self.ready = [threading.Event() for _ in range(n_layers)]
        self.cuda = pool.k.device.type == "cuda"
        self.events = [torch.cuda.Event() for _ in range(n_layers)] if self.cuda else []
        if self.cuda:                 # the side stream starts after the work queued so far
            self.queued = torch.cuda.Event()
            self.queued.record()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.perf_counter()
        self.thread.start()

    def _run(self) -> None:
        try:
            stream = torch.cuda.Stream(self.pool.k.device) if self.cuda else None
            if stream is not None:
                stream.wait_event(self.queued)
            for layer, ready in enumerate(self.ready):
                if stream is not None:
                    with torch.cuda.stream(stream):
                        self._copy_layer(layer)
                        self.events[layer].record(stream)
                else:
                    self._copy_layer(layer)
                ready.set()
        except BaseException as e:      # noqa: BLE001 - re-raised by wait() and finish()
            self.error = e
            for ready in self.ready:    # no layer waits forever
                ready.set()
        self.timing.load_seconds += time.perf_counter() - self.started

    def _copy_layer(self, layer: int) -> None:
        for blocks, load in self.loads:
            self.pool.write_layer(layer, blocks, load.kv[0, layer], load.kv[1, layer])

    def wait(self, layer: int) -> None:
        """Return once ``layer``'s KV is in the pool; raise if the copy failed."""
        start = time.perf_counter()
        self.ready[layer].wait()
        if self.error is not None:
            self.finish()
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.events[layer])
        self.timing.exposed_seconds += time.perf_counter() - start

    def finish(self) -> None:
        """Wait for the copy thread (after the forward pass); raise if the copy failed."""
        self.thread.join()
        self.timing.loads += 1
        if self.error is not None:
            raise RuntimeError("loading stored KV failed") from self.error


__all__ = ["OffloadConfig", "TieredKVStore", "MemoryTier", "DiskTier", "KVLoad", "LoadTiming",
           "LayerwiseLoad", "chunk_keys", "model_fingerprint", "encode_entry", "decode_entry",
           "write_atomic", "physical_memory", "TierStats"]
