"""The multilinear row digests of :mod:`caffe2ckpt.store.delta.rowhash` compiled to machine code
with llvmlite, when the ``fast`` extra (``pip install 'caffe2ckpt[fast]'``) is installed: one pass
over each block's words instead of numpy's three (widen, multiply-add per key row, combine),
about 4x faster on a 256 MiB table (docs/performance.md). Same function, same bits:
tests/store/test_rowhash.py checks both kernels against the formula.

The kernel is a few lines of LLVM IR (:data:`_IR`, one function per word width), optimised
for this machine's processor by a child process the first time (:func:`_compile`), and kept as
an object file in a cache folder of the user's (:func:`cache_dir`), keyed by the IR, how it is
compiled, the llvmlite and LLVM versions and the processor, with its SHA-256 (a torn or foreign
file is never loaded): every later process only loads that object (llvmlite's MCJIT), which
costs about half the memory of compiling it, or of importing a JIT compiler such as numba
(issue 56: a save's extra memory is bounded). So it is compiled once per user, machine and
llvmlite version. Without a private cache folder (none, or one others may write to) this
process compiles the kernel itself, at that memory's cost.

Importing this module imports llvmlite; :mod:`rowhash` does so lazily, at the first digest,
and falls back to numpy when it cannot, or when :func:`warm_up` fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm
import numpy as np

__all__ = ["cache_dir", "multilinear", "warm_up"]

WIDTHS = (32, 16, 8)  # bits per word the digests read blocks as (rowhash._words)
# out[i] = top 32 bits of (k0a + sum keys[0][j] * w[i][j]) << 32 | top 32 bits of the same with
# keys[1] (keys: 2 rows of n), for each row i of n words; arithmetic modulo 2**64
_IR = """
define void @multilinear_{w}(i8* noalias nocapture readonly %words, i64 %rows, i64 %n,
                             i64* noalias nocapture readonly %keys, i64 %k0a, i64 %k0b,
                             i64* noalias nocapture %out) nounwind {{
entry:
  %wp = bitcast i8* %words to i{w}*
  %k1 = getelementptr i64, i64* %keys, i64 %n
  %none = icmp eq i64 %rows, 0
  br i1 %none, label %exit, label %row
row:
  %i = phi i64 [0, %entry], [%inext, %rowend]
  %base = mul i64 %i, %n
  br label %word
word:
  %j = phi i64 [0, %row], [%jnext, %word]
  %a = phi i64 [%k0a, %row], [%a2, %word]
  %b = phi i64 [%k0b, %row], [%b2, %word]
  %at = add i64 %base, %j
  %wptr = getelementptr i{w}, i{w}* %wp, i64 %at
  %wv = load i{w}, i{w}* %wptr, align 1
  %we = zext i{w} %wv to i64
  %kap = getelementptr i64, i64* %keys, i64 %j
  %ka = load i64, i64* %kap, align 8
  %kbp = getelementptr i64, i64* %k1, i64 %j
  %kb = load i64, i64* %kbp, align 8
  %pa = mul i64 %ka, %we
  %pb = mul i64 %kb, %we
  %a2 = add i64 %a, %pa
  %b2 = add i64 %b, %pb
  %jnext = add i64 %j, 1
  %jdone = icmp uge i64 %jnext, %n
  br i1 %jdone, label %rowend, label %word
rowend:
  %ah = lshr i64 %a2, 32
  %ahs = shl i64 %ah, 32
  %bh = lshr i64 %b2, 32
  %digest = or i64 %ahs, %bh
  %optr = getelementptr i64, i64* %out, i64 %i
  store i64 %digest, i64* %optr, align 8
  %inext = add i64 %i, 1
  %idone = icmp uge i64 %inext, %rows
  br i1 %idone, label %exit, label %row
exit:
  ret void
}}
"""
_PROTO = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                          ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p)


def _source() -> str:
    return "".join(_IR.format(w=w) for w in WIDTHS)


def _target_machine() -> llvm.TargetMachine:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)


def _compile() -> bytes:
    """The kernel as an object file for this machine's processor, optimised."""
    machine = _target_machine()
    module = llvm.parse_assembly(_source())
    module.verify()
    builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(
        speed_level=3))
    builder.getModulePassManager().run(module, builder)
    return machine.emit_object(module)


_MAGIC = b"caffe2ckpt rowjit 1\n"  # then the object's SHA-256 (32 bytes), then the object
_COMPILE = "opt=3 speed_level=3 host cpu"  # how _compile compiles: part of the cache key


def cache_dir() -> Path | None:
    """Where compiled kernels are kept: ``$CAFFE2CKPT_CACHE_DIR``, else ``caffe2ckpt`` in
    ``$XDG_CACHE_HOME`` (an absolute path) or ``~/.cache``; None when there is no home."""
    explicit = os.environ.get("CAFFE2CKPT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    try:
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    except RuntimeError:  # no home directory to be found
        return None
    return base / "caffe2ckpt"


def _cached_path(folder: Path) -> Path:
    key = "\0".join([_source(), _COMPILE, llvmlite.__version__, repr(llvm.llvm_version_info),
                     llvm.get_default_triple(), llvm.get_host_cpu_name(),
                     llvm.get_host_cpu_features().flatten()])
    return folder / f"rowjit-{hashlib.sha256(key.encode()).hexdigest()[:24]}.o"


def _object() -> bytes:
    """The compiled kernel: from the cache, else compiled by a child process into the cache
    (a failure there is raised: a compiler that fails, or crashes, in a child would in this
    process too), else (no usable cache folder, or no Python to run a child with) compiled
    here."""
    folder = cache_dir()
    if folder is None or getattr(sys, "frozen", False) or not _private(folder):
        return _compile()
    path = _cached_path(folder)
    cached = _read(path)
    if cached is not None:
        return cached
    # -P: no folder of this package (nor the current one) shadows what the child imports
    done = subprocess.run([sys.executable, "-P", __file__, str(path)], timeout=300,
                          capture_output=True, text=True, check=False)
    cached = _read(path)
    if done.returncode or cached is None:
        raise RuntimeError(f"compiling the row-digest kernel into {path} failed (exit "
                           f"{done.returncode}): {done.stderr.strip()[-2000:]}")
    return cached


def _private(folder: Path) -> bool:
    """Whether ``folder`` exists or was made, is this user's and nobody else may write to it
    (a compiled kernel found there is run)."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        stat = folder.stat()
    except OSError:
        return False
    return stat.st_uid == os.getuid() and not stat.st_mode & 0o022


def _read(path: Path) -> bytes | None:
    """The object kept at ``path`` if it is whole (its SHA-256 checks: a torn or foreign file
    is never loaded, which could crash the process), else None."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head = len(_MAGIC) + 32
    digest, body = data[len(_MAGIC):head], data[head:]
    if not data.startswith(_MAGIC) or hashlib.sha256(body).digest() != digest:
        return None
    return body


def _write(path: Path) -> None:
    """Compile the kernel into ``path``, with its digest, durably and atomically (a reader sees
    all of it or nothing; nothing of a failed write is left)."""
    data = _compile()
    # closed in the block below, unlinked in the finally (a failed write leaves nothing)
    tmp = tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", delete=False)  # noqa: SIM115
    try:
        with tmp:
            tmp.write(_MAGIC + hashlib.sha256(data).digest() + data)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp.name, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp.name)
    with contextlib.suppress(OSError):
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


_loaded: tuple[llvm.ExecutionEngine, dict[int, ctypes._CFuncPtr]] | None = None
_loading = threading.Lock()


def _functions() -> tuple[llvm.ExecutionEngine, dict[int, ctypes._CFuncPtr]]:
    """The loaded kernel: its engine (which owns the machine code: it is never freed) and its
    functions. Loaded once per process, under a lock: two threads that loaded it at once each
    made an engine, one of which was freed while its thread ran its code (a SIGSEGV, seen in
    CI and then every time 8 threads first used the kernel together)."""
    global _loaded
    if _loaded is None:  # (read without the lock once loaded: the calls' hot path)
        with _loading:
            if _loaded is None:
                _loaded = _load()
    return _loaded


def _load() -> tuple[llvm.ExecutionEngine, dict[int, ctypes._CFuncPtr]]:
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), _target_machine())
    engine.add_object_file(llvm.ObjectFileRef.from_data(_object()))
    engine.finalize_object()
    found = {w: engine.get_function_address(f"multilinear_{w}") for w in WIDTHS}
    if not all(found.values()):
        raise RuntimeError(f"the compiled row-digest kernel lacks a function: {found}")
    return engine, {w: _PROTO(address) for w, address in found.items()}


def multilinear(words: np.ndarray, keys: np.ndarray, offsets: np.ndarray,
                out: np.ndarray) -> None:
    """``out[i]``: the two halves' top 32 bits of ``offsets[h] + sum(keys[h] * words[i])``
    modulo 2**64, for each row ``i`` of ``words`` (C-contiguous unsigned words of 8, 16 or 32
    bits; ``keys`` a C-contiguous (2, n) uint64 array; ``out`` a contiguous uint64 array of
    one digest per row). The call releases the GIL (ctypes does)."""
    rows, n = words.shape
    if not (words.flags.c_contiguous and keys.flags.c_contiguous and out.flags.c_contiguous
            and keys.shape == (2, n) and keys.dtype == np.uint64 and out.dtype == np.uint64
            and out.shape == (rows,) and words.dtype.kind == "u" and n > 0
            and words.dtype.itemsize * 8 in WIDTHS):
        raise ValueError("multilinear: words, keys or out are not laid out as the kernel needs")
    if rows:
        _functions()[1][words.dtype.itemsize * 8](
            words.ctypes.data, rows, n, keys.ctypes.data, int(offsets[0]), int(offsets[1]),
            out.ctypes.data)


def warm_up(reference: Callable[..., None]) -> None:
    """Load (or compile) the kernel and check it on one block of each word width against
    ``reference`` (numpy's sums), so that a failure shows here, at the choice of kernel, not in
    a save."""
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**64, (2, 3), np.uint64, endpoint=False)
    offsets = rng.integers(0, 2**64, 2, np.uint64, endpoint=False)
    for bits in WIDTHS:
        words = rng.integers(0, 2**bits, (2, 3), dtype=np.dtype(f"u{bits // 8}"))
        got, want = np.empty(2, np.uint64), np.empty(2, np.uint64)
        multilinear(words, keys, offsets, got)
        reference(words, keys, offsets, want)
        if not np.array_equal(got, want):
            raise RuntimeError(f"the compiled row-digest kernel disagrees with numpy on "
                               f"{bits}-bit words")


if __name__ == "__main__":  # the child process of _object(): python rowjit.py <path>
    _write(Path(sys.argv[1]))
