"""CUPTI Callback API through NVIDIA's cupti-python: sees every runtime and driver call of the
process, PyTorch's, a C++ extension's and a raw ctypes call's alike.

Only the callback ids of the APIs in ``events.WATCHED_APIS`` are enabled (synchronize, memcpy,
malloc), never kernel launches, so the hot path pays nothing. One CUPTI subscriber may exist per
process: this one must not run alongside torch.profiler or Nsight tools.
"""

from __future__ import annotations

import ctypes
import threading

from host_syncs.events import WATCHED_APIS, ApiCall, CopyInfo, EventRecorder, base_api_name

_RUNTIME_COPY_KINDS = {0: "h2h", 1: "h2d", 2: "d2h", 3: "d2d"}  # cudaMemcpyKind; 4 = default (by pointer)
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_MEMORYTYPE_HOST = 1


class CuptiUnavailable(RuntimeError):
    pass


def _import_cupti():
    try:
        from cupti import cupti  # noqa: PLC0415 - optional dependency
    except ImportError as error:
        raise CuptiUnavailable(
            f"cupti-python is not importable ({error}); pip install 'specdec-conformance[cupti]'"
        ) from None
    return cupti


class PointerTypes:
    """Device, pinned or pageable, for a raw pointer, from the driver (cuPointerGetAttribute)."""

    def __init__(self) -> None:
        self._get_attribute = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute
        self._get_attribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        self._get_attribute.restype = ctypes.c_int

    def __call__(self, pointer: int) -> str:
        memory_type = ctypes.c_uint(0)
        if self._get_attribute(ctypes.byref(memory_type), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, pointer) != 0:
            return "pageable"  # unknown to the driver: ordinary host memory
        return "pinned" if memory_type.value == _CU_MEMORYTYPE_HOST else "device"


def _params_class_name(cbid_name: str) -> str:
    """cudaMemcpyAsync_v3020 → CudaMemcpyAsyncV3020Params (cupti-python's naming)."""
    head, *rest = cbid_name.split("_")
    return head[0].upper() + head[1:] + "".join(part[0].upper() + part[1:] for part in rest if part) + "Params"


def _direction_from_types(source: str, destination: str) -> str:
    return ("d" if source == "device" else "h") + "2" + ("d" if destination == "device" else "h")


class CuptiStrategy:
    name = "cupti"
    blind_spots = (
        "sees every CUDA runtime and driver call of the process (PyTorch, C++ extensions, ctypes); "
        "cannot see a host spinning on mapped memory"
    )

    def __init__(self, recorder: EventRecorder) -> None:
        self.cupti = _import_cupti()
        self.recorder = recorder
        self.pointer_types = PointerTypes()
        self.subscriber = None
        self._names: dict[tuple[int, int], str] = {}
        self._params: dict[tuple[int, int], type | None] = {}

    def start(self) -> None:
        cupti = self.cupti
        try:
            self.subscriber = cupti.subscribe(self._callback, None)
        except Exception as error:  # noqa: BLE001 - CUPTI reports "multiple subscribers" and friends this way
            raise CuptiUnavailable(f"CUPTI subscribe failed ({error}); is another profiler attached?") from None
        domains = (
            (cupti.CallbackDomain.RUNTIME_API, cupti.RuntimeApiTraceCbid),
            (cupti.CallbackDomain.DRIVER_API, cupti.DriverApiTraceCbid),
        )
        self.unsupported_ids: list[str] = []
        for domain, cbids in domains:
            for cbid in cbids:
                if base_api_name(cbid.name) not in WATCHED_APIS:
                    continue
                try:
                    cupti.enable_callback(1, self.subscriber, domain, cbid)
                except Exception:  # noqa: BLE001 - ids this CUPTI build lists but does not trace
                    self.unsupported_ids.append(cbid.name)
                    continue
                key = (int(domain), int(cbid))
                self._names[key] = cbid.name
                self._params[key] = getattr(cupti, _params_class_name(cbid.name), None)
        if not self._names:
            self.stop()
            raise CuptiUnavailable("CUPTI accepted none of the synchronize/memcpy callback ids")

    def stop(self) -> None:
        if self.subscriber is not None:
            self.cupti.unsubscribe(self.subscriber)
            self.subscriber = None

    def _callback(self, userdata, domain, cbid, data) -> None:
        key = (int(domain), int(cbid))
        name = self._names.get(key)
        if name is None:
            return
        if not hasattr(data, "callback_site"):
            data = self.cupti.CallbackData.from_ptr(int(data))
        enter = int(data.callback_site) == int(self.cupti.ApiCallbackSite.API_ENTER)
        copy = self._copy_info(key, name, data) if enter and "Memcpy" in name else None
        runtime = int(domain) == int(self.cupti.CallbackDomain.RUNTIME_API)
        self.recorder.on_call(ApiCall("runtime" if runtime else "driver", name, enter, threading.get_ident(), copy))

    def _copy_info(self, key: tuple[int, int], name: str, data) -> CopyInfo:
        params_class = self._params.get(key)
        if params_class is None or not data.function_params:
            return CopyInfo()
        params = params_class.from_ptr(int(data.function_params), readonly=True)
        num_bytes = getattr(params, "count", None)
        if num_bytes is None:
            num_bytes = getattr(params, "byte_count", None)
        destination = next((getattr(params, f) for f in ("dst", "dst_host", "dst_device") if hasattr(params, f)), None)
        source = next((getattr(params, f) for f in ("src", "src_host", "src_device") if hasattr(params, f)), None)
        if "DtoH" in name:
            direction = "d2h"
        elif "HtoD" in name:
            direction = "h2d"
        elif "DtoD" in name:
            direction = "d2d"
        elif hasattr(params, "kind") and int(params.kind) in _RUNTIME_COPY_KINDS:
            direction = _RUNTIME_COPY_KINDS[int(params.kind)]
        elif source is not None and destination is not None:
            direction = _direction_from_types(self.pointer_types(int(source)), self.pointer_types(int(destination)))
        else:
            direction = None
        host_pointer = {"d2h": destination, "h2d": source}.get(direction)
        host_pinned = None if host_pointer is None else self.pointer_types(int(host_pointer)) == "pinned"
        return CopyInfo(direction, int(num_bytes) if num_bytes is not None else None, host_pinned)
