"""HF checkpoint directory <-> tpinv checkpoint, streamed one tensor at a time.

Everything about the input is checked before the first byte is written: ``config.json``
(architecture, sizes, TP split), every shard the index lists, every safetensors header
(truncation, corruption), every key (missing, unexpected) and every shape against the one
``config.json`` implies.  Values are copied verbatim, or cast once when a dtype is asked
for, so HF -> tpinv -> HF returns the same bits.  Output appears atomically (see
:mod:`tpinv.io.atomic_dir`): a failed conversion leaves no output directory.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Optional

import torch

from tpinv.io.atomic_dir import atomic_directory, copy_file, write_json
from tpinv.core.dtypes import dtype_name
from tpinv.io.checkpoint import (CheckpointError, CheckpointReader, TensorSource, read_info, read_json_file,
                              write_checkpoint)
from tpinv.core.contract import DEFAULT_LEAVES
from tpinv.models.args import ModelArgs
from tpinv.io.hf_keys import (args_from_dict, args_to_dict, fused_group, fused_parts, hf_config_from_args,
                                  is_ignored, param_specs, to_hf_name, to_tpinv_name)
from tpinv.models.args import check_model_sizes
from tpinv.io.safetensors_stream import SafetensorsReader, TensorSpec, write_safetensors

CONFIG_FILE, INDEX_FILE, SINGLE_FILE = "config.json", "model.safetensors.index.json", "model.safetensors"
#: Files copied along unchanged in both directions when present (tokenizer and generation settings).
SIDE_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "vocab.json", "merges.txt")
DEFAULT_MAX_SHARD_SIZE = 5 * 2**30


class HFWeights:
    """The safetensors files of a HF model directory, every header validated, nothing loaded."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        index_path = os.path.join(hf_dir, INDEX_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path} is not a valid safetensors index: {e!r}") from None
            for key, fname in weight_map.items():
                if not os.path.isfile(os.path.join(hf_dir, fname)):
                    raise CheckpointError(f"{fname}, listed in {INDEX_FILE} for {key}, is missing from {hf_dir}")
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(hf_dir, SINGLE_FILE)):
            weight_map, files = None, [SINGLE_FILE]
        else:
            found = [os.path.basename(p) for p in glob.glob(os.path.join(hf_dir, "*.bin"))]
            raise CheckpointError(f"{hf_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}"
                                  + (f"; found {found}: convert .bin weights to safetensors first" if found else ""))
        self.readers = {f: SafetensorsReader(os.path.join(hf_dir, f)) for f in files}
        self.file_of = {}
        for fname, reader in self.readers.items():
            for key in reader.specs:
                if weight_map is not None and weight_map.get(key) != fname:
                    raise CheckpointError(f"{key} in {fname} is not listed for that file in {INDEX_FILE}")
                self.file_of[key] = fname
        for key, fname in (weight_map or {}).items():
            if key not in self.file_of:
                raise CheckpointError(f"{key}, listed in {INDEX_FILE}, is missing from {fname}")

    def spec(self, key: str) -> TensorSpec:
        return self.readers[self.file_of[key]].specs[key]

    def read(self, key: str, index: tuple) -> torch.Tensor:
        return self.readers[self.file_of[key]].get(key, index)


def _check_tied_copy(weights: HFWeights, key: str, embed_key: str) -> None:
    """A tied config's stored ``lm_head`` may be dropped only when it equals the embedding bit for bit."""
    full = tuple(slice(None) for _ in weights.spec(key).shape)
    if embed_key not in weights.file_of:
        return  # the missing embedding is reported with the other missing keys
    a, b = weights.read(key, full), weights.read(embed_key, full)
    if a.dtype != b.dtype or not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
        raise CheckpointError(f"{key} in {weights.file_of[key]} differs from {embed_key}, but {CONFIG_FILE} sets "
                              f"tie_word_embeddings=true, which would drop it; set tie_word_embeddings to false "
                              f"in {CONFIG_FILE} to keep a separate output layer, or remove {key}")


def _shape_error(key: str, fname: str, got, want) -> CheckpointError:
    return CheckpointError(f"{key} in {fname} has shape {tuple(got)}, expected {tuple(want)} from {CONFIG_FILE}")


def _row_range(index: tuple, offset: int, rows: int) -> tuple:
    start, stop, _ = index[0].indices(rows)
    return (slice(offset + start, offset + stop),) + tuple(index[1:])


def plan_import(weights: HFWeights, args: ModelArgs, dtype: Optional[torch.dtype],
                row_strategy: str) -> list[TensorSource]:
    """One :class:`TensorSource` per tpinv tensor, after checking every HF key and shape."""
    specs = param_specs(args)
    by_hf = {s.hf_name: s for s in specs.values()}
    found: dict[str, tuple[str, int]] = {}
    for key in sorted(weights.file_of):
        fname, shape = weights.file_of[key], weights.spec(key).shape
        parts = fused_parts(key)
        if is_ignored(key):
            continue
        if parts is not None and all(p in by_hf for p in parts):
            rows = [by_hf[p].shape[0] for p in parts]
            want = (sum(rows),) + by_hf[parts[0]].shape[1:]
            if shape != want:
                raise _shape_error(key, fname, shape, want)
            offsets = [sum(rows[:i]) for i in range(len(rows))]
        elif key in by_hf or (key == "lm_head.weight" and args.tie_word_embeddings):
            want = by_hf[key].shape if key in by_hf else (args.vocab_size, args.hidden_size)
            if shape != want:
                raise _shape_error(key, fname, shape, want)
            if key not in by_hf:  # a tied checkpoint that still stores lm_head: only a copy of the embedding
                _check_tied_copy(weights, key, "model.embed_tokens.weight")
                continue
            parts, offsets = (key,), [0]
        else:
            raise CheckpointError(f"unexpected key {key} in {fname}: not a parameter of the {args.family} model "
                                  f"described by {CONFIG_FILE} (num_layers={args.num_layers}, qk_norm="
                                  f"{args.qk_norm}, attention_bias={args.attention_bias}, tie_word_embeddings="
                                  f"{args.tie_word_embeddings})")
        if not weights.spec(key).dtype.is_floating_point:
            raise CheckpointError(f"{key} in {fname} is {dtype_name(weights.spec(key).dtype)}; model weights must be "
                                  f"floating point (a cast would change the values silently)")
        for part, offset in zip(parts, offsets):
            if part in found:
                raise CheckpointError(f"{part} is stored twice in {weights.dir} ({found[part][0]} and {key})")
            found[part] = (key, offset)
    missing = [s.hf_name for s in specs.values() if s.hf_name not in found]
    if missing:
        raise CheckpointError(f"{weights.dir} is missing {len(missing)} key(s) that {CONFIG_FILE} implies: "
                              f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    sources = []
    for s in specs.values():
        key, offset = found[s.hf_name]
        read = (lambda i, k=key: weights.read(k, i)) if key == s.hf_name else (
            lambda i, k=key, o=offset, n=s.shape[0]: weights.read(k, _row_range(i, o, n)))
        sources.append(TensorSource(s.name, s.shape, dtype or weights.spec(key).dtype,
                                    s.partition_dim(row_strategy), read))
    return sources


def read_hf_config(hf_dir: str) -> tuple[dict, ModelArgs]:
    """``config.json`` and the :class:`ModelArgs` it describes; errors name the file."""
    path = os.path.join(hf_dir, CONFIG_FILE)
    cfg = read_json_file(path, "expected a HF model directory")
    try:
        return cfg, ModelArgs.from_hf_config(cfg)
    except NotImplementedError as e:
        raise NotImplementedError(f"{path}: {e}") from e
    except KeyError as e:
        raise CheckpointError(f"{path} lacks the field {e}") from e
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from e


def _side_files(src_dir: str) -> list[str]:
    return [os.path.join(src_dir, f) for f in SIDE_FILES if os.path.isfile(os.path.join(src_dir, f))]


def convert_hf_to_tpinv(hf_dir: str, out_dir: str, *, tp: int = 1, dtype: Optional[torch.dtype] = None,
                        leaves: int = DEFAULT_LEAVES, row_strategy: str = "tree", checksums: bool = True,
                        overwrite: bool = False, progress: bool = False) -> str:
    """Write the HF model in ``hf_dir`` as a tpinv checkpoint (``tp`` rank files, or one when 1).

    ``dtype=None`` keeps each tensor's dtype; otherwise every tensor is cast to ``dtype``.
    """
    cfg, args = read_hf_config(hf_dir)
    check_model_sizes(args, tp, leaves)
    weights = HFWeights(hf_dir)
    sources = plan_import(weights, args, dtype, row_strategy)
    args = args.replace(dtype=sources[0].dtype)
    return write_checkpoint(sources, out_dir, model_args=args_to_dict(args), tp=tp, leaves=leaves,
                            row_strategy=row_strategy, checksums=checksums, extra={"hf_config": cfg},
                            copy_files=_side_files(hf_dir), overwrite=overwrite, progress=progress)


def export_plan(reader: CheckpointReader, fuse: bool, dtype: Optional[torch.dtype]) -> list:
    """``(TensorSpec with the HF name, load)`` pairs; ``fuse`` stacks q/k/v and gate/up rows."""
    info, plan, done = reader.info, [], set()
    for name in info.tensors:
        if name in done:
            continue
        hf_name, group = to_hf_name(name), (name,)
        found = fused_group(hf_name) if fuse else None
        if found and all(to_tpinv_name(p) in info.tensors for p in found[1]):
            hf_name, group = found[0], tuple(to_tpinv_name(p) for p in found[1])
        specs = [info.spec(n) for n in group]
        if len({s.dtype for s in specs}) != 1:
            raise CheckpointError(f"cannot fuse {list(group)} into {hf_name}: their dtypes differ")
        shape = (sum(s.shape[0] for s in specs),) + specs[0].shape[1:]
        out_dtype = dtype or specs[0].dtype

        def load(g=group, d=out_dtype):
            parts = [reader.read(n) for n in g]
            return (parts[0] if len(parts) == 1 else torch.cat(parts, 0)).to(d)
        plan.append((TensorSpec(hf_name, out_dtype, shape if len(group) > 1 else specs[0].shape), load))
        done.update(group)
    return plan


def convert_tpinv_to_hf(tpinv_dir: str, out_dir: str, *, dtype: Optional[torch.dtype] = None, fuse: bool = False,
                        max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, verify: bool = True,
                        overwrite: bool = False, progress: bool = False) -> str:
    """Write a tpinv checkpoint (any TP layout) as a HF model directory.

    ``config.json`` is the one stored at import, or derived from the ModelArgs; weights go to
    ``model.safetensors``, or to ``model-0000i-of-0000N.safetensors`` with an index when they
    exceed ``max_shard_size`` bytes.  ``fuse=True`` writes ``qkv_proj`` / ``gate_up_proj``.
    ``verify`` checks each tensor read against the sha256 recorded in ``tpinv.json``.
    """
    info = read_info(tpinv_dir)
    args = args_from_dict(info.model_args)
    with CheckpointReader(tpinv_dir, verify) as reader:
        plan = export_plan(reader, fuse, dtype)
        out_dtype = plan[0][0].dtype
        cfg = dict(info.extra.get("hf_config") or hf_config_from_args(args))
        cfg["dtype"] = dtype_name(out_dtype)
        if "torch_dtype" in cfg:
            cfg["torch_dtype"] = dtype_name(out_dtype)
        groups, size = [[]], 0
        for spec, load in plan:
            if groups[-1] and size + spec.nbytes > max_shard_size:
                groups.append([])
                size = 0
            groups[-1].append((spec, load))
            size += spec.nbytes
        from tqdm import tqdm
        with tqdm(total=len(plan), desc="writing", unit="tensor", disable=not progress) as bar, \
                atomic_directory(out_dir, overwrite) as tmp:
            weight_map = {}
            for i, group in enumerate(groups):
                fname = SINGLE_FILE if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                write_safetensors(os.path.join(tmp, fname), group, {"format": "pt"},
                                  on_tensor=lambda spec: bar.update(1))
                weight_map.update({spec.name: fname for spec, _ in group})
            if len(groups) > 1:
                total = sum(spec.nbytes for spec, _ in plan)
                write_json(os.path.join(tmp, INDEX_FILE), {"metadata": {"total_size": total},
                                                           "weight_map": weight_map})
            write_json(os.path.join(tmp, CONFIG_FILE), cfg)
            for path in _side_files(tpinv_dir):
                copy_file(path, tmp)
    return os.path.abspath(out_dir)
