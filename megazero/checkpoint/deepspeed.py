"""Reading DeepSpeed checkpoints of a Hugging Face GPT-2 (what `engine.save_checkpoint(DIR)`
and the Hugging Face Trainer under DeepSpeed write), at any ZeRO stage and DP size, fp32 or
bf16, and DeepSpeed's universal checkpoint folders (`ds_to_universal.py`):

    DIR/latest                                  "global_stepN"
    DIR/config.json                             the GPT-2's config (the HF Trainer saves it beside;
                                                DeepSpeed itself does not record the model's shape)
                                                or, without one, the run's model section (below)
    DIR/global_stepN/mp_rank_00_model_states.pt             ZeRO 1/2: module, param_shapes, steps,
                                                            lr_scheduler, ds_config
    DIR/global_stepN/zero_pp_rank_R_mp_rank_00_model_states.pt   ZeRO 3: the same, per DP rank
    DIR/global_stepN/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   DP rank R's fp32 master
                                                            partition and Adam moments
    DIR/latest_universal, DIR/global_stepN_universal/zero/NAME/{fp32,exp_avg,exp_avg_sq}.pt

Where each parameter's elements live (learned from DeepSpeed's save code, not its reader):
ZeRO 1/2 flatten each parameter group and cut it into DP-rank partitions; the optimizer file
says where each parameter's piece starts in its rank's partition (`param_slice_mappings`),
and the pieces in rank order make the parameter. ZeRO 3 partitions each parameter on its own:
every rank holds ceil(numel / dp) elements of it (the last one padded), in parameter order.

A checkpoint without a config.json (a plain `engine.save_checkpoint(DIR)`) is read with the
model section the run states (train's config, convert's --config / --model.KEY): every shape
DeepSpeed recorded (`param_shapes`) must be that model's, and what shapes cannot tell (the number
of heads, LayerNorm's epsilon) is the run's; model.vocab_size auto is the recorded embedding's rows.

Every file is read with `torch.load(weights_only=True)`: besides tensors and containers,
DeepSpeed pickles three small types, which are unpickled into the plain stand-ins below
(DeepSpeed need not be installed, and none of its code runs). A file that needs any other
type is refused with one line.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import pickle
import re
from typing import Any, Optional

import torch

from megazero.checkpoint.base import Checkpoint, CheckpointError
from megazero.checkpoint.hf import from_hf
from megazero.checkpoint.hf_names import EMBEDDING, GPT2_CONV1D, HEAD, model_config_from_hf
from megazero.checkpoint.tensors import plain_shapes
from megazero.config.deepspeed import import_deepspeed
from megazero.config.parse import build_config
from megazero.config.schema import Config, ConfigError, ModelConfig
from megazero.data.tokenizer import spec_of_directory


class _LossScaler:
    """DeepSpeed's LossScaler / DynamicLossScaler, as its attributes (cur_scale, cur_iter, ...)."""


class _ZeroStage(int):
    """DeepSpeed's ZeroStageEnum (an IntEnum): the stage number."""


@dataclasses.dataclass
class _FragmentAddress:
    """DeepSpeed's fragment_address: where a parameter's piece starts in a rank's partition."""

    numel: int = 0
    start: int = 0


ALLOWED = [(_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
           (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
           (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
           (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address")]
"""The only non-torch types a DeepSpeed checkpoint may ask for (stand-ins, under DeepSpeed's names)."""

KIND_FILES = {"master": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
KIND = "DeepSpeed checkpoint"


@dataclasses.dataclass(frozen=True)
class OptimLayout:
    """Where DeepSpeed's optimizer files keep one ZeRO stage's state: its save code differs by
    stage, so the stage a checkpoint records is looked up here, once (OPTIM_LAYOUTS)."""

    master: str
    """Key of the rank's fp32 master partitions, one flat tensor per (sub-)group."""
    moments: str
    """Key of the wrapped torch optimizer's state_dict: Adam's moments and step per group."""
    per_parameter: bool
    """ZeRO 3 cuts each parameter into DP pieces on its own; ZeRO 1/2 cut each flattened group."""


_ZERO12 = OptimLayout("single_partition_of_fp32_groups", "base_optimizer_state", per_parameter=False)
OPTIM_LAYOUTS = {1: _ZERO12, 2: _ZERO12, 3: OptimLayout("fp32_flat_groups", "optimizer_state_dict", per_parameter=True)}
"""DeepSpeed's optimizer-file layout by the ZeRO stage it records (stage 0 writes no ZeRO state)."""


def load_ds_file(path: str) -> Any:
    """One DeepSpeed file, never running code from it: tensors, containers and ALLOWED only."""
    try:
        with torch.serialization.safe_globals(ALLOWED):  # type: ignore[arg-type]  # (class, name) pairs
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        wanted = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f"the type {wanted.group(1)}" if wanted else str(e).splitlines()[0]
        raise CheckpointError(f"{path} needs {what} to load, which is not one of the DeepSpeed types megazero "
                              f"reads; refused (loading it would run code from the file)") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path} is unreadable as a torch file: {str(e).splitlines()[0]}") from None


# ---------------------------------------------------------------------------- finding one


def deepspeed_folder(path: str) -> Optional[str]:
    """The global_stepN (or universal) folder that `path` names: itself, or the one its
    `latest` / `latest_universal` file names; None when `path` is no DeepSpeed checkpoint."""
    for name in ("latest", "latest_universal"):
        tag = os.path.join(path, name)
        if os.path.isfile(tag):
            with open(tag) as f:
                step = f.read().strip()
            if step.startswith("global_step"):
                return os.path.join(path, step)
    if os.path.isdir(path) and glob.glob(os.path.join(path, "*model_states.pt")):
        return path
    return None


def find_hf_config(folder: str) -> Optional[str]:
    """config.json of the GPT-2 a DeepSpeed folder holds: in it or in its parent; None without one."""
    for where in (folder, os.path.dirname(os.path.abspath(folder))):
        path = os.path.join(where, "config.json")
        if os.path.isfile(path):
            return path
    return None


def checked_model(recorded: dict[str, tuple[int, ...]], stated: ModelConfig, folder: str) -> ModelConfig:
    """The run's model section for a checkpoint that does not record its model, once every shape
    DeepSpeed recorded (HF names and layout, by megazero name) is that model's; a mismatch is one
    line naming the parameter and both shapes."""
    m = dataclasses.replace(stated)
    wte = recorded.get("transformer.wte.weight")
    if wte is None:
        raise CheckpointError(f"{KIND} '{folder}' records no transformer.wte.weight: not a GPT-2's parameters")
    if m.vocab_size == "auto":  # the data's tokenizer would say; the embedding does
        m.vocab_size = wte[0]
    if m.num_heads <= 0 or m.hidden_size % m.num_heads:
        raise CheckpointError(f"model.num_heads ({m.num_heads}) must divide model.hidden_size ({m.hidden_size})")
    expected = {n: s[::-1] if n.endswith(GPT2_CONV1D) else s for n, s in plain_shapes(m).items()}  # HF's Conv1D
    expected["transformer.wte.weight"] = (int(m.vocab_size), m.hidden_size)  # HF's has no padding rows
    fix = shapes_fix(recorded, m)
    for name in [*expected, *(n for n in recorded if n not in expected)]:
        theirs, mine = recorded.get(name), expected.get(name)
        if theirs != mine:
            raise CheckpointError(f"{KIND} '{folder}' does not hold this run's model: {name} has shape "
                                  f"{_shape(theirs)} there but {_shape(mine)} in the run's model section{fix}")
    return m


def shapes_fix(recorded: dict[str, tuple[int, ...]], m: ModelConfig) -> str:
    """"; its shapes say --model.KEY V ...": what the recorded shapes tell that differs from `m`."""
    def size(name: str, dim: int) -> Optional[int]:
        return recorded[name][dim] if name in recorded else None

    said = {"num_layers": len([n for n in recorded if n.endswith(".ln_1.weight")]),
            "hidden_size": size("transformer.wte.weight", 1), "vocab_size": size("transformer.wte.weight", 0),
            "seq_length": size("transformer.wpe.weight", 0),
            "ffn_hidden_size": size("transformer.h.0.mlp.c_fc.weight", 1)}  # HF's Conv1D: [in, out]
    # The MLP width the run would have once the other flags are taken: 0 is 4 x hidden_size.
    mine = {**{k: getattr(m, k) for k in said}, "ffn_hidden_size": m.ffn_hidden_size or 4 * (said["hidden_size"] or 0)}
    flags = [f"--model.{k} {v}" for k, v in said.items() if v is not None and v != mine[k]]
    return f"; its shapes say {' '.join(flags)}" if flags else ""


def _shape(shape: Optional[tuple[int, ...]]) -> str:
    return "(none)" if shape is None else str(list(shape))


# ---------------------------------------------------------------------------- reading one


class DeepSpeedReader:
    """Full fp32 tensors (master weights, Adam moments) by megazero parameter name, in
    megazero's storage layout, and the training position, of one DeepSpeed checkpoint.
    `stated`: the run's config, whose model section a checkpoint without config.json holds
    (checked against its shapes) and whose data.tokenizer it names."""

    def __init__(self, folder: str, stated: Optional[Config] = None) -> None:
        if not os.path.isdir(folder):
            raise CheckpointError(f"{KIND} folder '{folder}' does not exist")
        self.folder = folder
        self.universal = os.path.isdir(os.path.join(folder, "zero"))
        states = sorted(glob.glob(os.path.join(folder, "*model_states.pt")))
        if not states:
            raise CheckpointError(f"{KIND} '{folder}' has no *model_states.pt file")
        self.model_states = load_ds_file(states[0])
        if not isinstance(self.model_states, dict) or "param_shapes" not in self.model_states:
            raise CheckpointError(f"{KIND} '{folder}': {os.path.basename(states[0])} has no param_shapes; only ZeRO "
                                  f"checkpoints of a Hugging Face GPT-2 are read (not pipeline-module layer files)")
        if self.model_states.get("mp_world_size", 1) != 1:
            raise CheckpointError(f"{KIND} '{folder}' was saved with model parallelism ({self.model_states['mp_world_size']} "
                                  f"ranks); only data-parallel (ZeRO) checkpoints of a Hugging Face GPT-2 are read")
        self.dp = int(self.model_states.get("dp_world_size", 1))
        if not self.universal and not glob.glob(os.path.join(folder, "*optim_states.pt")):
            raise CheckpointError(f"{KIND} '{folder}' has no *optim_states.pt files: it was saved without ZeRO "
                                  f"(stage 0); ZeRO stages 1, 2 and 3 are read (save it with zero_optimization.stage "
                                  f"1 or more)")
        groups = self.model_states["param_shapes"]
        self.group_shapes = [dict(g) for g in (groups if isinstance(groups, list) else [groups])]
        self.names = {self._megazero_name(n): n for g in self.group_shapes for n in g}
        self.hf_config = find_hf_config(folder)
        self.model_config = self._model(stated.model if stated else None)
        self.model_stated = self.hf_config is None
        self._ranks: Optional[list[dict]] = None
        tokenizer = spec_of_directory(os.path.dirname(self.hf_config)) if self.hf_config else None
        self.config = self._run_config(tokenizer or (stated.data.tokenizer if stated and self.model_stated else None))

    def _model(self, stated: Optional[ModelConfig]) -> ModelConfig:
        """The GPT-2 held: its config.json's, else the run's model section that its shapes are."""
        if self.hf_config:
            with open(self.hf_config) as f:
                hf = json.load(f)
            try:
                return model_config_from_hf(hf)
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{KIND} '{self.folder}': its config.json is not a GPT-2 config ({e})") from None
        if stated is None:
            raise CheckpointError(f"{KIND} '{self.folder}' has no config.json beside it (in it or its parent folder): "
                                  f"DeepSpeed does not record the number of heads; state the model section "
                                  f"(convert --config FILE or --model.KEY VALUE), or save config.json there with "
                                  f"model.config.save_pretrained(DIR)")
        recorded = {self._megazero_name(n): tuple(s) for g in self.group_shapes for n, s in g.items()}
        return checked_model(recorded, stated, self.folder)

    @staticmethod
    def _megazero_name(ds_name: str) -> str:
        """GPT2LMHeadModel's name (a bare GPT2Model's lack 'transformer.'; a wrapper adds 'module.')."""
        name = ds_name.removeprefix("module.")
        return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name

    # -- optimizer files

    def _rank_states(self) -> list[dict]:
        """Each DP rank's optimizer_state_dict, in rank order (memory-mapped, loaded once)."""
        if self._ranks is None:
            self._ranks = [load_ds_file(self._optim_file(r))["optimizer_state_dict"] for r in range(self.dp)]
        return self._ranks

    def _optim_file(self, rank: int) -> str:
        found = glob.glob(os.path.join(self.folder, f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
        if not found:
            raise CheckpointError(f"{KIND} '{self.folder}' lacks DP rank {rank}'s optimizer file "
                                  f"(zero_pp_rank_{rank}_mp_rank_00_optim_states.pt) of its {self.dp} ranks")
        return found[0]

    @property
    def layout(self) -> OptimLayout:
        """How the optimizer files hold the state: by the ZeRO stage they record."""
        stage = int(self._rank_states()[0].get("zero_stage", 0))
        layout = OPTIM_LAYOUTS.get(stage)
        if layout is None:
            raise CheckpointError(f"{KIND} '{self.folder}' is ZeRO stage {stage}; stages 1, 2 and 3 are read "
                                  f"(save it with zero_optimization.stage 1 or more)")
        return layout

    def _flats(self, rank: int, kind: str) -> list[torch.Tensor]:
        """One rank's flat fp32 tensors of `kind`, one per (sub-)group, in order."""
        state, layout = self._rank_states()[rank], self.layout
        if kind == "master":
            return list(state[layout.master])
        inner = state[layout.moments]["state"]
        return [inner[i][kind] for i in sorted(inner)]

    # -- full tensors

    def full(self, name: str, kind: str = "master") -> torch.Tensor:
        """The whole parameter `name` (megazero's name; the tied head is the embedding), fp32."""
        if name == HEAD:
            name = EMBEDDING
        if name not in self.names:
            raise CheckpointError(f"{KIND} '{self.folder}' has no parameter {name}: not a GPT-2 of the shape its "
                                  f"config.json describes")
        ds_name = self.names[name]
        shape = next(g[ds_name] for g in self.group_shapes if ds_name in g)
        if self.universal:
            flat = self._universal_tensor(ds_name, kind)
        elif self.layout.per_parameter:
            flat = self._zero3_tensor(ds_name, kind)
        else:
            flat = self._zero12_tensor(ds_name, kind)
        return from_hf(name, flat.float().reshape(shape))

    def _zero12_tensor(self, ds_name: str, kind: str) -> torch.Tensor:
        """ZeRO 1/2: the parameter's pieces, in DP-rank order, where each rank's map says."""
        group = next(i for i, g in enumerate(self.group_shapes) if ds_name in g)
        pieces = []
        for rank, state in enumerate(self._rank_states()):
            maps = state.get("param_slice_mappings")
            if maps is None:
                return self._contiguous_tensor(group, ds_name, kind)
            where = maps[group].get(ds_name)
            if where is not None:
                pieces.append(self._flats(rank, kind)[group].narrow(0, where.start, where.numel))
        return torch.cat(pieces)

    def _contiguous_tensor(self, group: int, ds_name: str, kind: str) -> torch.Tensor:
        """ZeRO 1/2 before DeepSpeed recorded slice maps: the group's parameters back to back."""
        offset = 0
        for name, shape in self.group_shapes[group].items():
            if name == ds_name:
                whole = torch.cat([self._flats(r, kind)[group] for r in range(self.dp)])
                return whole.narrow(0, offset, math.prod(shape))
            offset += math.prod(shape)
        raise AssertionError(ds_name)

    def _zero3_tensor(self, ds_name: str, kind: str) -> torch.Tensor:
        """ZeRO 3: each rank's ceil(numel / dp) elements of it, at its place in that rank's flat."""
        offset = 0
        for shapes in self.group_shapes:
            for name, shape in shapes.items():
                numel = math.prod(shape)
                part = math.ceil(numel / self.dp)
                if name == ds_name:
                    pieces = [_narrow_across(self._flats(r, kind), offset, part) for r in range(self.dp)]
                    return torch.cat(pieces)[:numel]
                offset += part
        raise AssertionError(ds_name)

    def _universal_tensor(self, ds_name: str, kind: str) -> torch.Tensor:
        path = os.path.join(self.folder, "zero", ds_name, f"{KIND_FILES[kind]}.pt")
        if not os.path.isfile(path):
            raise CheckpointError(f"DeepSpeed universal checkpoint '{self.folder}' lacks {path}")
        value = load_ds_file(path)
        return value["param"] if isinstance(value, dict) else value  # ZeRO 1/2 write {"param": t}; ZeRO 3 t

    # -- the rest of the training state

    def _first_optimizer_state(self) -> tuple[dict, str]:
        """DP rank 0's optimizer state (a universal folder's optimizer_state.pt) and its moments' key."""
        if self.universal:
            return load_ds_file(os.path.join(self.folder, "zero", "optimizer_state.pt")), "optimizer_state_dict"
        return self._rank_states()[0], self.layout.moments

    def _optimizer_step(self) -> int:
        """Adam's step count (the same for every parameter and rank)."""
        if self.universal and (step_file := glob.glob(os.path.join(self.folder, "zero", "*", "step.pt"))):
            return int(load_ds_file(step_file[0]))
        state, moments = self._first_optimizer_state()
        inner = state[moments]["state"]
        return int(inner[min(inner)]["step"])

    def _loss_scaler(self) -> Optional[dict]:
        """DeepSpeed's dynamic fp16 loss scaler as megazero's; None when it scaled statically or not at all."""
        scaler = self._first_optimizer_state()[0].get("loss_scaler")
        values = vars(scaler) if isinstance(scaler, _LossScaler) else {}
        if not values.get("dynamic"):
            return None
        clean = values["cur_iter"] - values.get("last_overflow_iter", -1) - 1
        return {"scale": float(values["cur_scale"]), "clean_steps": clean % values["scale_window"],
                "hysteresis_left": int(values.get("cur_hysteresis", 1))}

    def _lr_schedule(self) -> Optional[dict]:
        """megazero's schedule state for the ds_config's scheduler at DeepSpeed's position in it;
        None (the run's own schedule, at the checkpoint's step) without a DeepSpeed scheduler."""
        saved = self.model_states.get("lr_scheduler") or {}
        if "scheduler" not in self.model_states.get("ds_config", {}) or "last_batch_iteration" not in saved:
            return None
        o = self.config.optim
        return {"lr": o.lr, "min_lr": o.min_lr, "warmup_iters": o.warmup_iters,
                "decay_iters": o.decay_iters or self.config.train.iters, "decay_style": o.decay_style,
                "steps": int(saved["last_batch_iteration"]) + 1}

    def trainer_state(self) -> dict:
        s = self.model_states
        return {"iteration": int(s["global_steps"]), "consumed_samples": int(s.get("global_samples", 0)),
                "skipped_iters": int(s.get("skipped_steps", 0)), "step": self._optimizer_step(),
                "loss_scaler": self._loss_scaler(), "lr_schedule": self._lr_schedule()}

    def _run_config(self, tokenizer: Optional[str]) -> Config:
        """A megazero config equivalent to the checkpoint's ds_config and GPT-2 (the `config` a
        universal export records)."""
        ds = self.model_states.get("ds_config") or {}
        base = build_config({"model": dataclasses.asdict(self.model_config)})
        try:
            sections = import_deepspeed(ds, base, self.dp).sections
        except ConfigError:  # e.g. another optimizer: the weights are still worth reading
            sections = {}
        return build_config({**sections, "model": dataclasses.asdict(self.model_config),
                             "data": {"tokenizer": tokenizer}})

    @property
    def meta(self) -> dict:
        return {"config": self.config.to_dict(), "iteration": int(self.model_states["global_steps"])}


def _narrow_across(flats: list[torch.Tensor], offset: int, length: int) -> torch.Tensor:
    """Elements [offset, offset + length) of the concatenation of `flats`, without concatenating."""
    pieces = []
    for flat in flats:
        if offset < flat.numel() and length > 0:
            take = min(length, flat.numel() - offset)
            pieces.append(flat.narrow(0, offset, take))
            length -= take
            offset = 0
        else:
            offset -= flat.numel()
    return torch.cat(pieces) if len(pieces) != 1 else pieces[0]


def open_deepspeed(path: str, stated: Optional[Config] = None) -> Checkpoint:
    """A DeepSpeed checkpoint (DIR with `latest`, a global_stepN folder, or a universal one) as a
    Checkpoint; `stated` is the run's config, for one without config.json (see DeepSpeedReader)."""
    folder = deepspeed_folder(path)
    if folder is None:
        raise CheckpointError(f"'{path}' is not a DeepSpeed checkpoint (no 'latest' naming a global_stepN folder, "
                              f"and no *model_states.pt)")
    reader = DeepSpeedReader(folder, stated)
    shapes = plain_shapes(reader.model_config)
    kind = "DeepSpeed universal checkpoint" if reader.universal else KIND
    return Checkpoint(folder, kind, reader.model_config, reader.config.data.tokenizer, reader.meta["iteration"], shapes,
                      lambda kind: ((n, reader.full(n, kind)) for n in shapes), training=reader)
