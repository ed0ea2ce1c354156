"""Tensors of a weight version in safetensors files: written by the trainer's publisher
(`write_file`, hashing while it writes), described for its manifest (`describe_files`), and read
by the engines that load a version in place (`read_tensors`). The only module of buffer/weights/
that imports torch."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors import safe_open

from buffer.storage import when_space
from protocol.weights import FileEntry, TensorEntry, sha256_file

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2"}


def describe_files(folder: str, names: list[str]) -> tuple[list[FileEntry], dict[str, TensorEntry]]:
    """Manifest entries (size, sha256, tensor dtypes and shapes) of some files in `folder`;
    trainer ranks describe the files they wrote in parallel."""
    files, tensors = [], {}
    for name in names:
        path = os.path.join(folder, name)
        files.append(FileEntry(name, os.path.getsize(path), sha256_file(path)))
        if name.endswith(".safetensors"):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    tensors[key] = TensorEntry(name, sl.get_dtype(), list(sl.get_shape()))
    return files, tensors

def write_file(folder: str, name: str, tensors: Mapping[str, torch.Tensor]
               ) -> tuple[FileEntry, dict[str, TensorEntry]]:
    """Write `tensors` as the safetensors file `folder/name` (fsynced) and return its
    manifest entries without reading the file back: each tensor's bytes go straight from
    its memory to the file, and the sha256 of piece k runs in a thread while piece k+1 is
    written (both release the GIL). What `save_file` + `describe` give, for about the cost
    of the write alone."""
    header, pieces, offset = {}, [], 0
    for key, t in sorted(tensors.items()):
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{key}: dtype {t.dtype} has no safetensors name")
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        header[key] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + raw.nbytes]}
        pieces.append(raw)
        offset += raw.nbytes
    header["__metadata__"] = {"format": "pt"}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data to 8 bytes
    pieces.insert(0, struct.pack("<Q", len(head)) + head)
    path = os.path.join(folder, name)

    def write() -> str:
        sha, hashing = hashlib.sha256(), None
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="sha256") as pool:
                with open(path, "wb") as f:
                    for piece in pieces:
                        f.write(piece)
                        if hashing is not None:
                            hashing.result()  # in order: the digest is of the file's bytes
                        hashing = pool.submit(sha.update, piece)
                    hashing.result()
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(path)  # a partial file would hold the space a retry needs
            raise
        return sha.hexdigest()

    digest = when_space(write, path)
    entries = {k: TensorEntry(name, v["dtype"], v["shape"])
               for k, v in header.items() if k != "__metadata__"}
    return FileEntry(name, len(pieces[0]) + offset, digest), entries


def read_tensors(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of safetensors files, one at a time (memory-mapped, bounded memory)."""
    for path in paths:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
