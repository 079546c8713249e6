"""Offline conversion of a sharded checkpoint (fsdpcpp.save_checkpoint's or fsdp-train's, saved on
any number of ranks) into one full state dict: no GPU, no ranks, no model code.

    python -m fsdpcpp.convert CHECKPOINT OUT --to torch         # OUT: a torch.save file
    python -m fsdpcpp.convert CHECKPOINT OUT --to safetensors   # OUT: a directory of weight files

CHECKPOINT is a checkpoint directory or a --save-dir holding step-N ones (the newest is taken).
The tensors are read one at a time, each block's checksum checked. `--to safetensors` writes the
weights as Hugging Face publishes them: files of at most --shard-gb with
model.safetensors.index.json (one model.safetensors where they fit one file); a checkpoint of a
transformers model saved by fsdpcpp then loads with from_pretrained beside its config.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

from . import _C
from ._checkpoint import BUFFER_PREFIX
DTYPES = {"keep": None, "fp32": torch.float32, "bf16": torch.bfloat16}


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _model_name(name: str) -> str:
    return name[len(BUFFER_PREFIX):] if name.startswith(BUFFER_PREFIX) else name


class _SafetensorsWriter:
    """Weights into files of at most `max_bytes` each (a larger tensor alone), named and indexed
    as Hugging Face names them (model-00001-of-0000N.safetensors, model.safetensors.index.json)."""

    def __init__(self, directory: str, max_bytes: int):
        from safetensors.torch import save_file
        self._save_file, self._dir, self._max_bytes = save_file, directory, max_bytes
        self._pending, self._pending_bytes, self._total_bytes = {}, 0, 0
        self._files = []  # [(staged file name, its tensors' names)]

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self._max_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self._total_bytes += size

    def _flush(self) -> None:
        staged = f"part-{len(self._files):05d}.safetensors"  # the count is known only at the end
        self._save_file(self._pending, os.path.join(self._dir, staged), metadata={"format": "pt"})
        self._files.append((staged, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> int:
        """Names the files and writes the index where there are several; returns their count."""
        if self._pending or not self._files:
            self._flush()
        count, weight_map = len(self._files), {}
        for i, (staged, names) in enumerate(self._files):
            final = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.rename(os.path.join(self._dir, staged), os.path.join(self._dir, final))
            weight_map.update({n: final for n in names})
        if count > 1:
            with open(os.path.join(self._dir, "model.safetensors.index.json"), "w") as out:
                json.dump({"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}, out, indent=2)
        return count


def convert(checkpoint: str, out: str, to: str, dtype: torch.dtype | None = None, shard_gb: float = 5.0,
            with_optimizer: bool = False, overwrite: bool = False) -> str:
    """The conversion `python -m fsdpcpp.convert` runs; returns what it wrote. Raises ValueError
    naming the problem (no checkpoint, an existing OUT without overwrite, optimizer state asked of
    safetensors)."""
    found = _C.newest_checkpoint(os.fspath(checkpoint)) if os.path.isdir(checkpoint) else ""
    if not found:
        raise ValueError(f"'{checkpoint}' holds no complete checkpoint (metadata.bin, or step-N directories "
                         "with one): give a checkpoint directory or a --save-dir")
    if os.path.lexists(out) and not overwrite:
        raise ValueError(f"'{out}' exists: pass --overwrite to replace it, or another path")
    if with_optimizer and to != "torch":
        raise ValueError("--with-optimizer needs --to torch (safetensors holds the weights a model loads)")
    staged = out + ".tmp"  # written whole, then put in OUT's place
    _remove(staged)  # an interrupted earlier conversion
    model, optimizer = {}, {}
    writer = None
    if to == "safetensors":
        os.makedirs(staged)
        writer = _SafetensorsWriter(staged, int(shard_gb * 1e9))

    def visit(name, tensor):
        if _C.is_optimizer_state(name):
            if with_optimizer:
                optimizer[name] = tensor
            return
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if writer is not None:
            writer.add(_model_name(name), tensor)
        else:
            model[_model_name(name)] = tensor

    _C.for_each_checkpoint_tensor(found, visit)
    if writer is not None:
        files = writer.close()
        what = f"{files} safetensors file(s)"
    else:
        torch.save({"model": model, "optimizer": optimizer} if with_optimizer else model, staged)
        what = f"{len(model)} tensors" + (f" and {len(optimizer)} optimizer entries" if with_optimizer else "")
    _remove(out)
    os.rename(staged, out)
    return f"{found} -> {out}: {what}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdpcpp.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory, or a --save-dir (its newest step-N)")
    parser.add_argument("out", help="the file (--to torch) or directory (--to safetensors) to write")
    parser.add_argument("--to", choices=["torch", "safetensors"], required=True)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="keep",
                        help="cast floating-point tensors (default: keep the saved dtypes)")
    parser.add_argument("--shard-gb", type=float, default=5.0,
                        help="--to safetensors: the largest file, GB (10^9 bytes)")
    parser.add_argument("--with-optimizer", action="store_true",
                        help="--to torch: also the optimizer state, as {'model': ..., 'optimizer': ...}")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    args = parser.parse_args(argv)
    if args.shard_gb <= 0:
        parser.error("--shard-gb must be positive")
    try:
        print("fsdpcpp.convert: " + convert(args.checkpoint, args.out, args.to, DTYPES[args.dtype], args.shard_gb,
                                            args.with_optimizer, args.overwrite))
    except (ValueError, RuntimeError) as e:
        print(f"fsdpcpp.convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
