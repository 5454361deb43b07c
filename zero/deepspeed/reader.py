"""``ZeroConfig.from_deepspeed``: a DeepSpeed JSON config translated to a :class:`zero.ZeroConfig`, key by key.

**One way.** This reader does not import ``zero.config``: :func:`read_deepspeed` translates the JSON into plain
``ZeroConfig`` field values (a dict of fields and mappings, as a user would pass them) and the training settings;
``ZeroConfig.from_deepspeed`` (in ``zero.config``, which imports this module) adds its ``overrides`` and validates
the fields into a ``ZeroConfig``. So ``zero.config`` depends on the reader and never the reverse; the reader
imports nothing of ``zero`` but its tables of keys (:mod:`zero.deepspeed.keys`) and the offload targets' table
(``zero.offload.TARGETS``: DeepSpeed's ``device`` names).

Every key of the DeepSpeed config meets one of four fates, and none is dropped unseen:

* **mapped** to a ``ZeroConfig`` field, or to the ``training`` settings returned beside it (below);
* **ignored, with a reason**: keys that change no number of the training run in ``zero`` (logging, batch
  sizes the data loader owns, communication-scheduling knobs that ``zero``'s design fixes); each one found
  is listed in :attr:`DeepSpeedConfig.ignored` with its reason;
* **accepted at a neutral value only**: features ``zero`` lacks (MiCS, static loss scaling, ...)
  pass when switched off (their DeepSpeed default) and are refused otherwise;
* **refused** with a ``ValueError`` naming the key path (``zero_optimization.offload_param.device='cpu'`` below stage 3)
  and the fix; any key not in these tables is refused as unknown. Keys the caller handles itself (typically
  ``optimizer`` and ``scheduler``: ``zero`` wraps a ``torch.optim`` optimizer you build) can be passed in
  ``ignore=`` to skip them on purpose.

**Training settings.** ``ZeroConfig`` holds no clipping or accumulation (they are calls, not settings), so
``from_deepspeed`` returns a :class:`DeepSpeedConfig` that unpacks as ``config, training``; ``training`` is
``{"gradient_clipping": float | None, "gradient_accumulation_steps": int}``, which the training loop applies:
``opt.clip_grad_norm_(gradient_clipping)`` before each ``opt.step()`` (when not ``None``), and the first
``gradient_accumulation_steps - 1`` micro-batches of each step inside ``with opt.no_sync():``, each loss
divided by ``gradient_accumulation_steps`` (DeepSpeed's engine divides it the same way).

**Defaults.** A key the config omits takes DeepSpeed's default where ``zero`` has the same knob (stage 0, no
mixed precision, no offload; fp16 loss scaling starting at 2**16, growing every 1000 clean steps, down to
1; no input casting without ``fp16.auto_cast``; gradients reduced in the training dtype without
``communication_data_type``). Bucket sizes take ``zero``'s default (25 MiB) when absent or ``"auto"``:
DeepSpeed's 5e8 elements would make one bucket of most models and end the overlap with backward; the
bucket size changes no number. One behaviour differs: DeepSpeed's fp16 ``hysteresis`` (default 2) skips an
overflowing step without lowering the scale once before it backs off; ``zero`` (as ``torch.amp.GradScaler``)
backs off on every overflow, i.e. ``hysteresis=1``, and an explicit ``hysteresis`` other than 1 is refused.

**"auto"** (as Hugging Face's integration writes it, to be filled from ``TrainingArguments``): taken as
``zero``'s default for keys that change no number (bucket sizes and the ignored keys); refused for every
other key (stage, precision, clipping, accumulation, loss scaling), because guessing those changes the run:
write the value, or let the Trainer integration resolve it first.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Iterable, Iterator, Mapping, TypeVar

from zero.deepspeed.keys import AUTO, IGNORED, MAPPED, NEUTRAL, REFUSED, ZO
from zero.offload import TARGETS

_DTYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16",
           "bf16": "bf16", "bfloat16": "bf16", "bfp16": "bf16"}


Config = TypeVar("Config")  # what ``DeepSpeedConfig.config`` holds


@dataclass(frozen=True)
class DeepSpeedConfig(Generic[Config]):
    """What :meth:`zero.ZeroConfig.from_deepspeed` returns; unpacks as ``config, training``.

    ``config``: the :class:`zero.ZeroConfig` (in what :func:`read_deepspeed` returns: the ``ZeroConfig`` fields
    it is built from, a dict, not yet validated). ``gradient_clipping``: the max norm for ``opt.clip_grad_norm_``
    before each step, or ``None`` (DeepSpeed's 0 or no key). ``gradient_accumulation_steps``: micro-batches per
    step (run all but the last inside ``opt.no_sync()``, each loss divided by it). ``ignored``: each key found
    that changes nothing in zero, with the reason."""

    config: Config
    gradient_clipping: float | None = None
    gradient_accumulation_steps: int = 1
    ignored: dict[str, str] = field(default_factory=dict)

    @property
    def training(self) -> dict[str, Any]:
        return {"gradient_clipping": self.gradient_clipping,
                "gradient_accumulation_steps": self.gradient_accumulation_steps}

    def __iter__(self) -> Iterator[Any]:
        return iter((self.config, self.training))


def read_deepspeed(source: str | Path | Mapping[str, Any], ignore: Iterable[str] = ()
                   ) -> DeepSpeedConfig[dict[str, Any]]:
    """Translate a DeepSpeed config (a mapping, or the path of its JSON file) as the module docstring says, into
    the ``ZeroConfig`` field values (``config``, a dict) and the training settings; ``ZeroConfig.from_deepspeed``
    validates the fields (with its overrides on top) into the ``ZeroConfig``.

    ``ignore``: key paths (``"optimizer"``, ``"zero_optimization.stage3_max_live_parameters"``) you handle
    yourself, skipped on purpose."""
    data = _load(source)
    reader = _Reader(set(ignore))
    reader.walk(data, "")
    fields = reader.fields(data)
    return DeepSpeedConfig(fields, reader.clipping, reader.accumulation, reader.ignored)


def _load(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); DeepSpeed configs are JSON") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object (a DeepSpeed config), got {type(data).__name__}")
    return data


class _Reader:
    """Checks every key against the tables, then reads the mapped ones."""

    def __init__(self, ignore: set[str]) -> None:
        self.ignore = ignore
        self.ignored: dict[str, str] = {}
        self.clipping: float | None = None
        self.accumulation = 1

    def walk(self, section: Mapping[str, Any], prefix: str) -> None:
        """Classify every key of ``section`` (recursing into the mapped sections); refuse what is not known."""
        for key, value in section.items():
            path = f"{prefix}{key}"
            if path in self.ignore:
                self.ignored[path] = "skipped on request (ignore=)"
            elif path in IGNORED:
                self.ignored[path] = IGNORED[path]
            elif path in NEUTRAL:
                accepted, why = NEUTRAL[path]
                if value != AUTO and not any(value == a and type(value) is type(a) for a in accepted):
                    shown = ", ".join(repr(a) for a in accepted)
                    raise ValueError(f"DeepSpeed key {path}={value!r} is not supported: {why}. "
                                     f"Remove it or set it to {shown}.")
                self.ignored[path] = f"at the value zero's behaviour matches (other values refused: {why})"
            elif path in REFUSED:
                raise ValueError(f"DeepSpeed key {path} is not supported: {REFUSED[path]}.")
            elif path in MAPPED:
                if isinstance(value, Mapping):
                    self.walk(value, f"{'bf16' if path == 'bfloat16' else path}.")
                elif path in (ZO, "fp16", "bf16", "bfloat16", f"{ZO}.offload_optimizer", f"{ZO}.offload_param"):
                    if value is not None:
                        raise ValueError(f"DeepSpeed key {path} must be a JSON object, got {value!r}")
            else:
                raise ValueError(f"unknown DeepSpeed key {path}: from_deepspeed does not know it, so it cannot "
                                 "tell what it would change. Remove it, or pass ignore=[" + repr(path) + "] if "
                                 "it does not concern zero.")

    def fields(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """The ZeroConfig fields (and the training settings, on ``self``) of the mapped keys."""
        zo = _section(data, ZO)
        fp16, bf16 = _section(data, "fp16"), _section(data, "bf16") or _section(data, "bfloat16")
        fields: dict[str, Any] = {}
        stage = self.get(zo, f"{ZO}.stage", int, 0)
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"DeepSpeed key {ZO}.stage={stage} must be 0, 1, 2 or 3")
        fields["stage"] = stage
        half = self.get(fp16, "fp16.enabled", bool, False)
        brain = self.get(bf16, "bf16.enabled", bool, False)
        for name, section, enabled in (("fp16", fp16, half), ("bf16", bf16, brain)):
            for key in section if not enabled else ():
                if key != "enabled" and f"{name}.{key}" not in self.ignored:
                    self.ignored[f"{name}.{key}"] = f"{name} is not enabled"
        if half and brain:
            raise ValueError("DeepSpeed keys fp16.enabled and bf16.enabled are both true; enable one of them")
        param_dtype = "fp16" if half else "bf16" if brain else None
        comm = self.get(data, "communication_data_type", str, None)
        if comm is not None and comm not in _DTYPES:
            raise ValueError(f"DeepSpeed key communication_data_type={comm!r} is not a dtype zero knows; use one of "
                             f"{', '.join(sorted(_DTYPES))}")
        reduce_dtype = _DTYPES[comm] if comm is not None else param_dtype
        if param_dtype is None and reduce_dtype not in (None, "fp32"):
            raise ValueError(f"DeepSpeed key communication_data_type={comm!r} needs fp16 or bf16 training: zero "
                             "reduces full-precision gradients in their own dtype. Enable bf16/fp16 or remove it.")
        if param_dtype is not None:
            precision: dict[str, Any] = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype,
                                         "cast_forward_inputs": half and self.get(fp16, "fp16.auto_cast", bool, False)}
            if half:
                precision["loss_scale"] = self.loss_scale(fp16)
            fields["precision"] = precision
        fields.update(self.buckets(zo, stage, param_dtype))
        fields["offload"] = self.offload(zo, stage)
        fields["communication"] = self.communication(zo, stage)
        clip = self.get(data, "gradient_clipping", float, 0.0)
        if clip < 0:
            raise ValueError(f"DeepSpeed key gradient_clipping={clip} must be >= 0 (0: no clipping)")
        self.clipping = clip or None
        self.accumulation = self.get(data, "gradient_accumulation_steps", int, 1)
        if self.accumulation < 1:
            raise ValueError(f"DeepSpeed key gradient_accumulation_steps={self.accumulation} must be >= 1")
        return fields

    def loss_scale(self, fp16: Mapping[str, Any]) -> dict[str, Any]:
        power = self.get(fp16, "fp16.initial_scale_power", int, 16)
        hysteresis = self.get(fp16, "fp16.hysteresis", int, 1)
        if hysteresis != 1:
            raise ValueError(
                f"DeepSpeed key fp16.hysteresis={hysteresis} is not supported: zero (as torch.amp.GradScaler) lowers "
                "the loss scale on every overflowing step, which is hysteresis 1. Set fp16.hysteresis to 1.")
        if "consecutive_hysteresis" in fp16:
            self.get(fp16, "fp16.consecutive_hysteresis", bool, False)  # type-checked only
            self.ignored["fp16.consecutive_hysteresis"] = "refills the hysteresis: a no-op at hysteresis 1"
        if not 0 <= power <= 64:
            raise ValueError(f"DeepSpeed key fp16.initial_scale_power={power} must be in 0..64")
        return {"init_scale": float(2**power), "growth_factor": 2.0, "backoff_factor": 0.5,
                "growth_interval": self.get(fp16, "fp16.loss_scale_window", int, 1000),
                "min_scale": float(self.get(fp16, "fp16.min_loss_scale", float, 1.0))}

    def buckets(self, zo: Mapping[str, Any], stage: int, param_dtype: str | None) -> dict[str, Any]:
        """DeepSpeed counts bucket elements; zero's buckets hold bucket_size_mb of the compute dtype."""
        paths = [f"{ZO}.reduce_bucket_size"] + ([f"{ZO}.allgather_bucket_size"] if stage < 3 else [])
        sizes = {p: self.get(zo, p, int, None, auto=True) for p in paths}
        if stage == 3 and "allgather_bucket_size" in zo:
            self.ignored[f"{ZO}.allgather_bucket_size"] = "DeepSpeed does not use it at stage 3 (units are gathered)"
        given = {p: s for p, s in sizes.items() if s is not None}
        if not given:
            return {}
        if len(set(given.values())) > 1:
            raise ValueError(f"DeepSpeed keys {' and '.join(given)} differ ({', '.join(map(str, given.values()))}); "
                             "zero's buckets are reduce-scattered and all-gathered whole, with one size. Set both to "
                             "the same number of elements, or keep one.")
        elements = next(iter(given.values()))
        if elements < 1:
            raise ValueError(f"DeepSpeed key {next(iter(given))}={elements} must be at least 1 element")
        itemsize = 2 if param_dtype in ("fp16", "bf16") else 4
        return {"bucket_size_mb": elements * itemsize / 2**20}

    def offload(self, zo: Mapping[str, Any], stage: int) -> dict[str, Any]:
        """``offload_optimizer`` and ``offload_param``: each ``device`` is the offload target DeepSpeed names so
        (``zero.offload.TARGETS``' ``deepspeed`` names: ``'nvme'`` is offload to disk)."""
        targets = {target.deepspeed: target for target in TARGETS if target.deepspeed is not None}
        offload: dict[str, Any] = {"optimizer": "none", "params": "none"}
        disk: dict[str, Any] = {}  # nvme: the directory and buffer count each section gives
        for key, ours in (("offload_optimizer", "optimizer"), ("offload_param", "params")):
            section = _section(zo, key)
            if not section:
                continue
            path = f"{ZO}.{key}.device"
            device = self.get(section, path, str, "cpu")
            if device not in targets:
                known = ", ".join(repr(name) for name, target in targets.items() if not target.on_device)
                raise ValueError(f"DeepSpeed key {path}={device!r}: zero offloads to {known} (or 'none')")
            offload[ours] = targets[device].name
            if key == "offload_optimizer":  # ZeRO-Offload++: the fraction stepped on the host (partial offload)
                ratio = self.get(section, f"{ZO}.offload_optimizer.ratio", float, 1.0)
                if ratio != 1.0:
                    offload["ratio"] = ratio
            if targets[device].needs_path:  # (DeepSpeed's nvme_path and buffer_count)
                disk[key] = (self.get(section, f"{ZO}.{key}.nvme_path", str, None),
                             self.get(section, f"{ZO}.{key}.buffer_count", int, None))
        if disk:
            offload.update(self.nvme(disk))
        device = {target.name: name for name, target in targets.items() if not target.on_device}
        if offload["params"] in device and stage != 3:
            raise ValueError(f"DeepSpeed key {ZO}.offload_param.device={device[offload['params']]!r} needs {ZO}.stage "
                             f"3 (got {stage}): only stage 3 shards the parameters. Set stage 3, or remove "
                             "offload_param.")
        if offload["optimizer"] in device and stage == 0:
            raise ValueError(f"DeepSpeed key {ZO}.offload_optimizer.device={device[offload['optimizer']]!r} needs "
                             f"{ZO}.stage 1, 2 or 3 (got 0): stage 0 keeps the whole optimizer state on every rank.")
        return offload

    def nvme(self, disk: dict[str, tuple[str | None, int | None]]) -> dict[str, Any]:
        """``device: 'nvme'`` is zero's offload to disk: one ``path`` (``nvme_path``) and ``buffer_count``."""
        paths = {key: path for key, (path, _) in disk.items()}
        if None in paths.values():
            key = next(k for k, p in paths.items() if p is None)
            raise ValueError(f"DeepSpeed key {ZO}.{key}.device='nvme' needs {ZO}.{key}.nvme_path: the directory "
                             "that holds the offload files")
        if len(set(paths.values())) > 1:
            raise ValueError(f"DeepSpeed keys {ZO}.offload_optimizer.nvme_path and {ZO}.offload_param.nvme_path "
                             "differ; zero keeps one offload file per rank, in one directory. Give both the same.")
        counts = {count for _, count in disk.values() if count is not None}
        if len(counts) > 1:
            raise ValueError(f"DeepSpeed keys {ZO}.offload_optimizer.buffer_count and {ZO}.offload_param."
                             "buffer_count differ; zero maps one window of buckets. Give both the same.")
        return {"path": next(iter(paths.values())), **({"buffer_count": counts.pop()} if counts else {})}

    def communication(self, zo: Mapping[str, Any], stage: int) -> dict[str, Any]:
        """ZeRO++: quantized weights (qwZ) and gradients (qgZ), and hierarchical partitioning (hpZ)."""
        comm: dict[str, Any] = {
            "quantized_weights": self.get(zo, f"{ZO}.zero_quantized_weights", bool, False),
            "quantized_gradients": self.get(zo, f"{ZO}.zero_quantized_gradients", bool, False),
        }
        hpz = self.get(zo, f"{ZO}.zero_hpz_partition_size", int, 1)
        if hpz < 1:
            raise ValueError(f"DeepSpeed key {ZO}.zero_hpz_partition_size={hpz} must be at least 1 (1: off)")
        if hpz > 1:
            comm.update(shard_size=hpz, hierarchy="hpz")
        for key, on in (("zero_quantized_weights", comm["quantized_weights"]), ("zero_hpz_partition_size", hpz > 1)):
            if on and stage != 3:
                raise ValueError(f"DeepSpeed key {ZO}.{key} needs {ZO}.stage 3 (got {stage}): it concerns the "
                                 "parameter gathers only stage 3 makes. Set stage 3, or remove it.")
        return comm

    def get(self, section: Mapping[str, Any], path: str, kind: type, default: Any, auto: bool = False) -> Any:
        """``section[last part of path]`` checked to be a ``kind`` (JSON's 5e8 counts as an int), or
        ``default``; ``"auto"`` is ``default`` where ``auto`` allows it, else refused."""
        key = path.rsplit(".", 1)[-1]
        if path in self.ignore or key not in section:
            return default
        value = section[key]
        if value == AUTO and isinstance(value, str):
            if auto:
                self.ignored[path] = "'auto': zero's default"
                return default
            raise ValueError(f"DeepSpeed key {path}='auto' cannot be resolved here: it changes the training run, "
                             "and 'auto' is filled by Hugging Face's Trainer from TrainingArguments. Write the value.")
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = not isinstance(value, bool) and (isinstance(value, int) or (
                isinstance(value, float) and math.isfinite(value) and value.is_integer()))
            value = int(value) if ok else value
        elif kind is float:
            ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            value = float(value) if ok else value
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise ValueError(f"DeepSpeed key {path}={value!r} must be {'an' if kind is int else 'a'} {kind.__name__}")
        return value


def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key)
    return value if isinstance(value, Mapping) else {}
