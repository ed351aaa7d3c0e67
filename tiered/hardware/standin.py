"""The host stand-in's device: tensors that live on it, kept apart from host tensors as CUDA keeps them.

The host stand-in accelerator (hardware/accelerator.HostAccelerator) computes with CPU memory, so
nothing in torch stops a tensor on its "device" from meeting a host tensor. CUDA does stop it,
and a device bug that passes on the stand-in crashes on the first real GPU (it did: DESIGN.md,
"The accelerator on machines without one"). So the stand-in marks its tensors and checks them:

- `StandinTensor` is a CPU tensor that reports `STANDIN_DEVICE` ("privateuseone:0", PyTorch's
  slot for out-of-tree backends) as its device. Its `__torch_function__` refuses any op that
  mixes it with a host tensor (0-dim host tensors excepted, as CUDA accepts CPU scalars):
  arithmetic, cat, matmul, in-place updates, a host tensor indexed by device indices and a device
  tensor indexed by host indices. Ops on device tensors return device tensors.
- Crossing is explicit. Host -> device only through the accelerator (`to_device`,
  `copy_to_device`, `alloc`); `Tensor.to(<stand-in device>)` and `device_tensor.copy_(host)` are
  refused so that every H2D copy in the engine goes through the accelerator. Device -> host as on
  CUDA: `.cpu()`, `.to("cpu")`, `host.copy_(device)`, `.item()`, `.tolist()`, `int()` (each a
  copy); `.numpy()` raises, as it does for a CUDA tensor.
- `StandinScope` is a TorchFunctionMode active while stand-in code runs (the accelerator's
  `scope()` and its streams): inside it a factory given the stand-in device
  (`torch.arange(n, device=x.device)`, `torch.zeros(..., device=...)`) makes a device tensor. A
  factory without a device makes a host tensor, exactly as on CUDA.

`device_memory()` meters what the device holds while it is open, as `torch.cuda.max_memory_allocated`
does on CUDA: every storage a device tensor is made on counts from its first device tensor until its
last one is gone, and the peak of the sum is kept. A budget's checks say what the engine reserved;
the meter says what it really held, transients included.

Errors are `StandinDeviceError` (a RuntimeError) naming the op, both sides, the CUDA message it
stands for, and the accelerator call that fixes it. A device tensor asked for outside the scope
(e.g. `torch.zeros(n, device=acc.device)` on a worker thread) raises one too: a stub runtime module
for the "privateuseone" slot, which reports no real device, says so.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

STANDIN_DEVICE = torch.device("privateuseone", 0)
_TYPE = STANDIN_DEVICE.type

_DisableSubclass = torch._C.DisableTorchFunctionSubclass
_T = torch.Tensor
_ITEM = (_T.__getitem__, _T.__setitem__)
_FIX = "move data across only with the accelerator's copies (Accelerator.to_device / copy_to_device / to_host)"


class StandinDeviceError(RuntimeError):
    """A tensor on the host stand-in's device met a host tensor outside the accelerator's copies
    (CUDA raises a RuntimeError in the same places)."""


def is_standin_device(device) -> bool:
    """True when `device` (torch.device or str) is the stand-in's device."""
    if isinstance(device, torch.device):
        return device.type == _TYPE
    return isinstance(device, str) and device.split(":", 1)[0] == _TYPE


def _is_host_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cpu"
    return isinstance(device, str) and device.split(":", 1)[0] == "cpu"


def _name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


def _scan(items, found: list) -> None:
    """found = [device tensors seen, first host tensor with dims (or None)]; recurses into lists/tuples."""
    for a in items:
        if isinstance(a, _T):
            if type(a) is StandinTensor:
                found[0] += 1
            elif found[1] is None and a.dim() > 0 and not a.is_meta:
                found[1] = a
        elif isinstance(a, (list, tuple)):
            _scan(a, found)


class DeviceMemoryMeter:
    """Bytes the stand-in's device holds, and their peak, over the storages of live device tensors
    (made while the meter is open: `device_memory()`). A storage counts once however many tensors
    view it, from its first device tensor until the last is collected."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a finalizer may run (on a collection) inside `add`
        self._live: dict[int, list[int]] = {}  # storage data_ptr -> [bytes, device tensors viewing it]
        self.bytes = 0
        self.peak = 0
        self.largest: list[tuple[int, str]] = []  # (bytes, shape/dtype) of the storages made, largest first

    def add(self, t: torch.Tensor) -> None:
        with _DisableSubclass():
            st = t.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
        if not nbytes:
            return
        with self._lock:
            entry = self._live.get(ptr)
            if entry is None:
                self._live[ptr] = entry = [nbytes, 0]
                self.bytes += nbytes
                self.peak = max(self.peak, self.bytes)
                self.largest = sorted(self.largest + [(nbytes, f"{tuple(t.shape)} {t.dtype}")], reverse=True)[:8]
            entry[1] += 1
        weakref.finalize(t, self._drop, ptr)

    def _drop(self, ptr: int) -> None:
        with self._lock:
            entry = self._live.get(ptr)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] <= 0:
                del self._live[ptr]
                self.bytes -= entry[0]


_meter: DeviceMemoryMeter | None = None


@contextmanager
def device_memory():
    """Meter the stand-in device's memory while the block runs (DeviceMemoryMeter; one at a time):

        with device_memory() as m:
            llm = LLM(...)
        m.peak  # bytes the device held at most, transients included
    """
    global _meter
    if _meter is not None:
        raise RuntimeError("a device memory meter is already open")
    _meter = m = DeviceMemoryMeter()
    try:
        yield m
    finally:
        _meter = None


def made_on_device(t: torch.Tensor) -> torch.Tensor:
    """`t` (a StandinTensor just made) counted by the open meter, if any; returns it."""
    m = _meter
    if m is not None:
        m.add(t)
    return t


def _wrap(out):
    """Outputs of an op on device tensors: tensors become StandinTensors (lists/tuples/structseqs kept)."""
    if isinstance(out, _T):
        return out if type(out) is StandinTensor else made_on_device(out.as_subclass(StandinTensor))
    if isinstance(out, (tuple, list)):
        return type(out)(_wrap(o) for o in out)
    return out


def _has_device_tensor(obj) -> bool:
    if type(obj) is StandinTensor:
        return True
    return isinstance(obj, (list, tuple)) and any(_has_device_tensor(o) for o in obj)


def _mix_error(func, args, host: torch.Tensor) -> StandinDeviceError:
    first = args[0] if args else None
    if (func in _ITEM and isinstance(first, _T) and type(first) is not StandinTensor
            and len(args) > 1 and _has_device_tensor(args[1])):
        return StandinDeviceError(
            f"stand-in device check: {_name(func)} indexes a host tensor (cpu, shape {tuple(first.shape)}) "
            f"with indices on the accelerator ({STANDIN_DEVICE}); CUDA refuses this too (\"indices should be "
            f"either on cpu or on the same device as the indexed tensor (cpu)\"). Bring the indices to the "
            f"host with Accelerator.to_host")
    return StandinDeviceError(
        f"stand-in device check: {_name(func)} got tensors on the accelerator ({STANDIN_DEVICE}) and on the host "
        f"(cpu, shape {tuple(host.shape)}); CUDA refuses this too (\"Expected all tensors to be on the same "
        f"device\"); {_FIX}")


def _h2d_error(what: str) -> StandinDeviceError:
    return StandinDeviceError(
        f"stand-in device check: {what} copies host data to the accelerator ({STANDIN_DEVICE}) outside the "
        f"accelerator's copy calls; use Accelerator.to_device(t) or Accelerator.copy_to_device(dst, src)")


def _to_target(args, kwargs):
    """The device a Tensor.to call moves to: a torch.device / str (STANDIN_DEVICE or "cpu" for
    `x.to(other_tensor)`), or None (a dtype change only)."""
    dev = kwargs.get("device")
    if dev is not None:
        return dev
    if len(args) > 1:
        a = args[1]
        if isinstance(a, (str, torch.device)):
            return a
        if isinstance(a, _T):
            return STANDIN_DEVICE if type(a) is StandinTensor else "cpu"
    return None


def _retarget(args, kwargs):
    """args/kwargs of a call with the stand-in device replaced by "cpu" (where its memory is)."""
    if "device" in kwargs:
        kwargs = dict(kwargs, device="cpu")
    elif len(args) > 1 and isinstance(args[1], (str, torch.device)):
        args = (args[0], "cpu") + tuple(args[2:])
    elif len(args) > 1 and type(args[1]) is StandinTensor:  # x.to(other): keep other's dtype
        args = (args[0], args[1].dtype) + tuple(args[2:])
    return args, kwargs


# Ops that read a device tensor's values on the host, or need them to size their output: host syncs,
# which CUDA refuses while a stream is captured into a graph ("operation not permitted when stream is
# capturing"). `capturing()` makes the stand-in refuse them the same way.
_SYNCS = frozenset({
    _T.item, _T.tolist, _T.cpu, _T.__bool__, _T.__int__, _T.__float__, _T.__index__,
    _T.nonzero, torch.nonzero, _T.unique, torch.unique, torch.unique_consecutive, _T.bincount, torch.bincount,
    _T.masked_select, torch.masked_select, _T.repeat_interleave, torch.repeat_interleave,
})


def _syncs(func, args, kwargs) -> bool:
    """Whether a call of a function in _SYNCS reads device data on the host. repeat_interleave does
    only with repeats given as a tensor (or as its one argument) and no output_size, as on CUDA."""
    if func not in (_T.repeat_interleave, torch.repeat_interleave):
        return True
    if len(args) < 2 and "repeats" not in kwargs:  # torch.repeat_interleave(repeats)
        return True
    repeats = args[1] if len(args) > 1 else kwargs["repeats"]
    output_size = args[3] if len(args) > 3 else kwargs.get("output_size")
    return isinstance(repeats, torch.Tensor) and output_size is None


class ThreadFlag:
    """A per-thread switch: `with flag():` turns it on for the block on the calling thread (nested
    blocks restore what was there), `bool(flag)` reads it for the calling thread."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __bool__(self) -> bool:
        return getattr(self._local, "on", False)

    @contextmanager
    def __call__(self):
        before = bool(self)
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = before


# While on for a thread, a host sync on a stand-in tensor (`.item()`, `.tolist()`, `int()`, `.cpu()`,
# `.to("cpu")`, `nonzero`, `unique`, `bincount`, ...) raises StandinDeviceError, as CUDA refuses it
# inside a captured graph (Accelerator.capture on the stand-in): `with capturing(): ...`.
capturing = ThreadFlag()


def _sync_error(what: str) -> StandinDeviceError:
    return StandinDeviceError(
        f"stand-in device check: {what} on a tensor on the accelerator ({STANDIN_DEVICE}) while a graph is "
        f"captured: a host sync, which CUDA refuses there too (\"operation not permitted when stream is "
        f"capturing\"); keep the captured work on the device (static shapes, device-side indices)")


def _device_get(args, kwargs):
    return STANDIN_DEVICE


def _false(args, kwargs):
    return False


def _numpy(args, kwargs):
    raise TypeError(f"can't convert a tensor on the stand-in accelerator ({STANDIN_DEVICE}) to numpy (CUDA "
                    f"refuses it too); copy it to the host first with Tensor.cpu() or Accelerator.to_host")


def _cpu(args, kwargs):
    with _DisableSubclass():
        return args[0].clone()  # a D2H copy: a new host tensor


def _to(args, kwargs):
    self = args[0]
    if type(self) is not StandinTensor:  # host.to(device_tensor): the only way a host self gets here
        raise _h2d_error("Tensor.to")
    target = _to_target(args, kwargs)
    if target is not None and not is_standin_device(target):  # D2H
        if capturing:
            raise _sync_error("Tensor.to(cpu)")
        if not _is_host_device(target):
            raise StandinDeviceError(f"stand-in device check: Tensor.to({target}) from the stand-in's device")
        if len(args) > 1 and isinstance(args[1], _T):
            args = (args[0], args[1].dtype) + tuple(args[2:])
        with _DisableSubclass():
            out = _T.to(*args, **kwargs)
            return out.clone() if out is self else out
    args, kwargs = _retarget(args, kwargs)
    with _DisableSubclass():
        return _wrap(_T.to(*args, **kwargs))


def _copy(args, kwargs):
    dst, src = args[0], args[1]
    if type(dst) is StandinTensor and type(src) is not StandinTensor and src.dim() > 0:
        raise _h2d_error("Tensor.copy_")
    with _DisableSubclass():
        _T.copy_(*args, **kwargs)
    return dst


def _repr(args, kwargs):
    with _DisableSubclass():
        plain = _T.as_subclass(args[0], _T)
    return f"{plain!r} on the stand-in device {STANDIN_DEVICE}"


_SPECIAL = {
    _T.device.__get__: _device_get,
    _T.is_cpu.__get__: _false,
    _T.numpy: _numpy,
    _T.cpu: _cpu,
    _T.to: _to,
    _T.copy_: _copy,
    _T.__repr__: _repr,
}


class StandinTensor(torch.Tensor):
    """A tensor on the host stand-in accelerator's device (its memory is CPU memory).

    Made only by the stand-in (HostAccelerator.alloc / to_device, factories inside its scope, ops
    on other StandinTensors); nn.Parameter keeps the type. `.device` is STANDIN_DEVICE.

    Raises:
        StandinDeviceError: an op mixes it with a host tensor that has dims, or copies host data
            into it outside the accelerator's copy calls.
        TypeError: `.numpy()` (as for a CUDA tensor).
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func in _SYNCS and capturing and _syncs(func, args, kwargs):
            raise _sync_error(_name(func))
        special = _SPECIAL.get(func)
        if special is not None:
            return special(args, kwargs)
        device = kwargs.get("device")
        if device is not None:  # a factory-like call (new_zeros, empty_like, ...) naming its device
            on_device = is_standin_device(device)
            if on_device:
                kwargs = dict(kwargs, device="cpu")
        else:
            found = [0, None]
            _scan(args, found)
            if kwargs:
                _scan(kwargs.values(), found)
            if found[1] is not None:
                raise _mix_error(func, args, found[1])
            on_device = found[0] > 0
        with _DisableSubclass():
            out = func(*args, **kwargs)
        return _wrap(out) if on_device else out


class StandinScope(TorchFunctionMode):
    """While active on a thread, factories given the stand-in device make StandinTensors, and
    `host.to(<stand-in device>)` is refused (use Accelerator.to_device). Everything else passes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if StandinTensor not in types:  # no device tensor in the call: only a factory can make one
            device = kwargs.get("device")
            if device is None and func is _T.to and len(args) > 1 and isinstance(args[1], (str, torch.device)):
                device = args[1]
            if device is not None and is_standin_device(device):
                if func is _T.to:
                    raise _h2d_error("Tensor.to")
                args, kwargs = _retarget(args, kwargs)
                return _wrap(func(*args, **kwargs))
        return func(*args, **kwargs)


def _outside_scope() -> None:
    raise StandinDeviceError(
        f"stand-in device check: a tensor was asked for on the stand-in's device ({STANDIN_DEVICE}) outside its "
        f"scope (a factory given the device, or .to(device), on a thread not running stand-in code); make device "
        f"tensors with Accelerator.alloc / to_device, or run the code inside accelerator.scope()")


def _install_runtime_stub() -> None:
    """Outside StandinScope, torch would look for a real "privateuseone" backend and fail with
    "No module named 'torch.privateuseone'". A stub runtime module, which reports no such device
    (is_available() is False), turns that into a StandinDeviceError saying what happened. Skipped
    when a real out-of-tree backend owns the slot."""
    try:
        if torch._C._get_privateuse1_backend_name() != _TYPE or hasattr(torch, _TYPE):
            return
        import types

        stub = types.ModuleType(f"torch.{_TYPE}")
        stub.__doc__ = "tiered's host stand-in: no real device (see tiered/hardware/standin.py)"
        stub._lazy_init = _outside_scope
        stub.is_available = lambda: False
        stub.device_count = lambda: 0
        stub._is_in_bad_fork = lambda: False  # torch.manual_seed seeds registered device modules:
        stub.manual_seed_all = lambda seed: None  # the stand-in's random numbers are the host's
        torch._register_device_module(_TYPE, stub)
    except (AttributeError, RuntimeError):  # another torch build: keep torch's own error
        pass


_install_runtime_stub()
