"""Check GPU telemetry on a real NVIDIA GPU: every NVML call the agent's GPU collector makes, on every device,
timed; the collector end to end under PCIe (and, with two GPUs, NVLink) traffic; PCIe readings through
sustained copies; the otel allocator fragmentation metrics on torch's real CUDA caching allocator; and gradient
offload under static and gradient-aware schedules with real pinned-memory copies. Runs in well under a minute.

Run on a GPU host: .venv/bin/python bench/gpu_check.py   (without an NVIDIA GPU/driver: one line, exit code 2)
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pynvml

from prismlb.agent._gpu import (
    _COUNTER_BITS,
    _PCIE_FIELDS,
    ALL_LINKS,
    NVLINK_GBPS_PER_LINK,
    PCIE_GBPS_PER_LANE,
    GpuCollector,
)

Row = tuple[str, str, str, float]
_FIELD_NAMES = {
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: "DATA_TX KiB",
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: "DATA_RX KiB",
    pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT: "LINK_COUNT",
    pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON: "SPEED_MBPS_COMMON",
    pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: "PCIE_TX_BYTES",
    pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: "PCIE_RX_BYTES",
}
_VALUE_MEMBERS = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
_STATS_FIELDS = (
    "fragmentation_ratio",
    "free_entropy",
    "largest_free_ratio",
    "largest_free_bytes",
    "free_bytes",
    "reserve_advice_bytes",
)
_MIB = 1 << 20


def timed(rows: list[Row], device: str, name: str, *args: Any, label: str = "") -> Any:
    """Run the NVML call `name`, add its table row (value or error, µs) and return the value (None on error)."""
    start = time.perf_counter()
    try:
        value = getattr(pynvml, name)(*args)
    except pynvml.NVMLError as exc:
        text, value = f"error: {type(exc).__name__} ({exc})", None
    else:
        text = describe(value)
    rows.append((name + label, device, text, (time.perf_counter() - start) * 1e6))
    return value


def describe(value: Any) -> str:
    if isinstance(value, pynvml.nvmlPciInfo_t):
        return f"busId {value.busId}"
    if isinstance(value, pynvml.c_nvmlMemory_v2_t):
        used, reserved, total = (round(part / _MIB) for part in (value.used, value.reserved, value.total))
        return f"used {used} MiB, reserved {reserved} MiB, total {total} MiB"
    if isinstance(value, pynvml.c_nvmlUtilization_t):
        return f"gpu {value.gpu} %, memory {value.memory} %"
    if isinstance(value, list) and value and hasattr(value[0], "pid"):
        return ", ".join(f"pid {p.pid}: {p.usedGpuMemory} B" for p in value)
    if hasattr(value, "_length_") and hasattr(value, "_type_"):  # a ctypes array: the affinity words or field values
        items = list(value)
        if items and isinstance(items[0], pynvml.c_nvmlFieldValue_t):
            return "; ".join(field_value(item) for item in items)
        return " ".join(f"{word:#x}" for word in items)
    return str(value)


def field_value(value: pynvml.c_nvmlFieldValue_t) -> str:
    name = _FIELD_NAMES.get(value.fieldId, str(value.fieldId))
    scope = "all" if value.scopeId == ALL_LINKS else str(value.scopeId)
    if value.nvmlReturn != pynvml.NVML_SUCCESS:
        return f"{name}[{scope}] error {pynvml.NVMLError(value.nvmlReturn)}"
    member = _VALUE_MEMBERS.get(value.valueType)
    reading = getattr(value.value, member) if member else f"type {value.valueType}"
    return f"{name}[{scope}]={reading} @{value.timestamp} µs (type {value.valueType})"


def nvml_rows(count: int) -> list[Row]:
    """Every NVML call of the collector on every device, plus the fields that check its bandwidth tables."""
    rows: list[Row] = []
    handles = []
    for index in range(count):
        device = f"GPU {index}"
        handle = timed(rows, device, "nvmlDeviceGetHandleByIndex", index)
        if handle is None:
            continue
        handles.append((device, handle))
        for name in ("nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetPciInfo"):
            timed(rows, device, name, handle)
        timed(rows, device, "nvmlDeviceGetMemoryInfo", handle, pynvml.nvmlMemory_v2, label="(v2)")
        timed(rows, device, "nvmlDeviceGetUtilizationRates", handle)
        timed(rows, device, "nvmlDeviceGetPcieThroughput", handle, pynvml.NVML_PCIE_UTIL_TX_BYTES, label="(TX) KB/s")
        timed(rows, device, "nvmlDeviceGetPcieThroughput", handle, pynvml.NVML_PCIE_UTIL_RX_BYTES, label="(RX) KB/s")
        generation = timed(rows, device, "nvmlDeviceGetMaxPcieLinkGeneration", handle)
        width = timed(rows, device, "nvmlDeviceGetMaxPcieLinkWidth", handle)
        if generation in PCIE_GBPS_PER_LANE and width:
            capacity = PCIE_GBPS_PER_LANE[generation] * width
            rows.append(("PCIe capacity (table)", device, f"{capacity:.1f} GB/s per direction", 0.0))
        links = nvlink_rows(rows, device, handle)
        fields = [
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, links[0] if links else 0),
            (pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, 0),
            (pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON, 0),
            # cumulative PCIe byte counters: a non-blocking alternative to nvmlDeviceGetPcieThroughput's 20 ms window
            (pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0),
            (pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0),
        ]
        timed(rows, device, "nvmlDeviceGetFieldValues", handle, fields)
        timed(rows, device, "nvmlDeviceGetNumaNodeId", handle)
        timed(rows, device, "nvmlDeviceGetCpuAffinity", handle, max(1, -(-(os.cpu_count() or 1) // 64)))
        timed(rows, device, "nvmlDeviceGetComputeRunningProcesses", handle)
        timed(rows, device, "nvmlDeviceGetGraphicsRunningProcesses", handle)
    for position, (first, first_handle) in enumerate(handles):
        for second, second_handle in handles[position + 1 :]:
            timed(rows, f"{first}, {second}", "nvmlDeviceGetTopologyCommonAncestor", first_handle, second_handle)
    return rows


def nvlink_rows(rows: list[Row], device: str, handle: Any) -> list[int]:
    """Link states (one row), then version, remote PCI info and remote type of each link that is up."""
    states: list[str] = []
    start = time.perf_counter()
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            states.append(str(pynvml.nvmlDeviceGetNvLinkState(handle, link)))
        except pynvml.NVMLError as exc:
            states.append(type(exc).__name__.removeprefix("NVMLError_"))
            if isinstance(exc, pynvml.NVMLError_InvalidArgument):
                break
    elapsed = (time.perf_counter() - start) * 1e6
    rows.append((f"nvmlDeviceGetNvLinkState × {len(states)}", device, " ".join(states), elapsed))
    up = [link for link, state in enumerate(states) if state in ("1", "2")]  # active or asleep
    for link in up:
        version = timed(rows, device, "nvmlDeviceGetNvLinkVersion", handle, link, label=f"({link})")
        if link == up[0] and version in NVLINK_GBPS_PER_LINK:
            capacity = f"{NVLINK_GBPS_PER_LINK[version] * len(up):.1f} GB/s per direction over {len(up)} links"
            rows.append(("NVLink capacity (table)", device, capacity, 0.0))
        timed(rows, device, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link, label=f"({link})")
        timed(rows, device, "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link, label=f"({link})")
    return up


def print_table(rows: list[Row]) -> None:
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    print(f"{'call':<{widths[0]}}  {'device':<{widths[1]}}  {'µs':>9}  value or error")
    for call, device, value, micros in rows:
        print(f"{call:<{widths[0]}}  {device:<{widths[1]}}  {micros:>9.1f}  {value}")


class Traffic:
    """About `seconds` of host-to-device copies (PCIe) and, with two GPUs, GPU 0 to GPU 1 copies (NVLink) queued
    on the CUDA streams; the copy time is measured after a warm-up, so the traffic lasts as long as asked."""

    def __init__(self, seconds: float) -> None:
        import torch

        self._torch = torch
        self.host = torch.empty(256 * _MIB, dtype=torch.uint8).pin_memory()
        device = torch.empty_like(self.host, device="cuda:0")
        for rounds in (4, 8):  # the first round warms the copy engines up; the second is timed
            start = time.perf_counter()
            for _ in range(rounds):
                device.copy_(self.host, non_blocking=True)
            torch.cuda.synchronize(0)
        self.copies = max(1, round(seconds / ((time.perf_counter() - start) / 8)))
        peer = torch.empty_like(device, device="cuda:1") if torch.cuda.device_count() > 1 else None
        self.nvlink = peer is not None
        self.start = time.perf_counter()
        for _ in range(self.copies):
            device.copy_(self.host, non_blocking=True)
            if peer is not None:
                peer.copy_(device, non_blocking=True)

    def finish(self) -> tuple[float, float]:
        """Wait for the copies; (seconds they took, host-to-device bytes per second)."""
        for index in range(self._torch.cuda.device_count()):
            self._torch.cuda.synchronize(index)
        seconds = time.perf_counter() - self.start
        return seconds, self.copies * self.host.numel() / seconds

    def describe(self, seconds: float, rate: float) -> str:
        peers = ", same volume GPU 0 → GPU 1" if self.nvlink else ", one GPU: no NVLink traffic"
        return f"torch: {self.copies} × 256 MiB host → GPU 0 in {seconds:.2f} s = {rate / 1e9:.1f} GB/s{peers}"


def collector_check(cuda: bool) -> None:
    """The agent's collector end to end: a sample, another about 1 s into 2 s of copies, then one idle."""
    collector, reason = GpuCollector.open()
    print(f"\nGpuCollector.open(): {reason}")
    if collector is None:
        return
    with collector:
        collector.sample()
        traffic = Traffic(2.0) if cuda else None
        time.sleep(1.0)
        start = time.perf_counter()
        loaded = collector.sample()
        print(f"collector.sample() under load took {(time.perf_counter() - start) * 1e3:.1f} ms")
        if traffic is not None:
            print(traffic.describe(*traffic.finish()))
        time.sleep(1.0)
        idle = collector.sample()
        for label, sample in (("under load", loaded), ("idle", idle)):
            print(f"sample {label}: {sample.node}")
            for state in sample.devices:
                print(f"  {state}")
        print(f"processes(): {collector.processes()}")
        topology = collector.topology()
        for device in topology.devices:
            print(f"topology: {device}")
        print(f"common ancestors: {topology.common_ancestor}")


def pcie_check() -> None:
    """GPU 0's PCIe readings every 0.25 s through 3 s of host-to-device copies: nvmlDeviceGetPcieThroughput (a
    20 ms window; the call blocks about as long) and the cumulative byte counters from field values, whose
    deltas are shown raw and modulo their width since the last row and over 10 ms, each against the rate torch
    measured over the whole run."""
    import torch

    if not torch.cuda.is_available():
        print("\nPCIe check skipped: torch sees no CUDA device")
        return
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def counters() -> list[tuple[int, int, int]]:
        """(value, timestamp µs, width in bits) of TX and RX, read as the agent's collector reads them."""
        out = []
        for value in pynvml.nvmlDeviceGetFieldValues(handle, _PCIE_FIELDS):
            if value.nvmlReturn != pynvml.NVML_SUCCESS:
                raise pynvml.NVMLError(value.nvmlReturn)
            if value.valueType not in _COUNTER_BITS:
                raise ValueError(f"value type {value.valueType} is no counter")
            member, width = _COUNTER_BITS[value.valueType]
            out.append((int(getattr(value.value, member)), value.timestamp, width))
        return out

    try:
        previous = counters()
    except (pynvml.NVMLError, ValueError) as exc:
        print(f"\nPCIe counters unreadable ({exc}): throughput calls only")
        previous = []
    traffic = Traffic(3.5)
    rows = []
    while time.perf_counter() - traffic.start < 3.0:
        started = time.perf_counter()
        tx = pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
        call_ms = (time.perf_counter() - started) * 1e3 / 2
        deltas = ""
        if previous:
            current = counters()
            parts = []
            for name, (before, then, width), (now, at, _) in zip(("TX", "RX"), previous, current, strict=True):
                seconds = max(at - then, 1) / 1e6
                raw, wrapped = (now - before) / seconds, (now - before) % (1 << width) / seconds
                span = f"GB/s over {seconds:.3f} s"
                parts.append(f"{name} {raw / 1e9:+.2f} raw, {wrapped / 1e9:.2f} mod 2^{width} {span}")
            time.sleep(0.01)  # a second read 10 ms on: no 32-bit byte counter wraps within it below 400 GB/s
            previous = counters()
            for name, (before, then, width), (now, at, _) in zip(("TX", "RX"), current, previous, strict=True):
                parts.append(f"{name} {(now - before) % (1 << width) / max(at - then, 1) / 1e3:.2f} GB/s in 10 ms")
            deltas = "; counters: " + ", ".join(parts)
        at = started - traffic.start
        throughput = f"throughput TX {tx / 1e6:.2f} RX {rx / 1e6:.2f} GB/s ({call_ms:.1f} ms a call)"
        rows.append(f"  t={at:.2f} s: {throughput}{deltas}")
        time.sleep(0.25)
    seconds, rate = traffic.finish()
    print(f"\nPCIe readings during copies ({traffic.describe(seconds, rate)}):")
    print(*rows, sep="\n")


def reserve_advice(stats: Any) -> object:
    if hasattr(stats, "reserve_advice_bytes"):
        return stats.reserve_advice_bytes
    try:
        from prismlb.otel import ReservationAdvisor
    except ImportError:
        return "not available yet"
    return f"{ReservationAdvisor('dynamic').update(stats)} (ReservationAdvisor, one dynamic sample)"


def print_allocator(label: str, snapshot: list[dict[str, Any]]) -> None:
    try:
        from prismlb.otel import allocator_stats_from_snapshot
    except ImportError as exc:
        print(f"{label}: allocator_stats_from_snapshot not available yet ({exc})")
        return
    result = allocator_stats_from_snapshot(snapshot)
    if not result:
        print(f"{label}: no allocator segments")
    for stats in result if isinstance(result, list) else [result]:
        values = {name: getattr(stats, name, None) for name in _STATS_FIELDS}
        values["reserve_advice_bytes"] = reserve_advice(stats)
        print(f"{label}: " + ", ".join(f"{name}={value}" for name, value in values.items()))


def allocator_check() -> None:
    """Fragment torch's CUDA caching allocator on purpose and show the otel metrics before and after."""
    import torch

    print(f"\nallocator (PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}):")
    keep = [torch.empty(64 * _MIB, dtype=torch.uint8, device="cuda:0")]
    print_allocator("before (one 64 MiB tensor)", torch.cuda.memory_snapshot())
    # 1-8 MiB blocks share 20 MiB segments; freeing every other one leaves holes between live blocks
    sizes = [(1 + (index * 7) % 8) * _MIB + (index % 5) * 4096 for index in range(600)]
    tensors = [torch.empty(size, dtype=torch.uint8, device="cuda:0") for size in sizes]
    keep.extend(tensors[::2])
    del tensors
    torch.cuda.synchronize(0)
    print_allocator("fragmented (300 of 600 mixed 1-8 MiB blocks freed)", torch.cuda.memory_snapshot())
    del keep
    torch.cuda.empty_cache()
    print_allocator("after freeing all and empty_cache()", torch.cuda.memory_snapshot())


def offload_check() -> None:
    """Gradient offload with real copies: each step's gradients of bench/offload.py's model (at GPU size) go
    from GPU 0 into pinned host memory in 4 MiB synchronous copies, under the two static schedules and the
    gradient-aware one; the emulated link runs on the wall clock, its bucket at the pinned copy rate
    measured first, so the copies set the pace and the schedule sets the order."""
    import torch

    if not torch.cuda.is_available():
        print("\noffload check skipped: torch sees no CUDA device")
        return
    import offload  # bench/offload.py: this script's directory is the first entry of sys.path

    from prismlb.otel import EmulatedLink, WallClock

    probe = torch.empty(256 * _MIB, dtype=torch.uint8, device="cuda:0")
    pinned = torch.empty_like(probe, device="cpu").pin_memory()
    pinned.copy_(probe)
    start = time.perf_counter()
    for _ in range(4):
        pinned.copy_(probe)
    rate = 4 * probe.numel() / (time.perf_counter() - start)
    del probe, pinned
    link = EmulatedLink(rate, chunk_bytes=4 * _MIB, clock=WallClock())
    shape = offload.GPU_SHAPE
    print(f"\noffload (device → pinned host, {shape}): pinned copy rate {rate / 1e9:.1f} GB/s")
    sources: dict[str, Any] = {}
    hosts: dict[str, Any] = {}
    results: list[Any] = []

    def send(transfer: Any, offset: int, nbytes: int) -> None:
        hosts[transfer.layer][offset : offset + nbytes].copy_(sources[transfer.layer][offset : offset + nbytes])

    def on_gradients(step: int, layers: Any, rates: Any, model: Any) -> None:
        modules = dict(model.named_modules())
        for layer in layers:
            grads = [p.grad.reshape(-1) for p in modules[layer.name].parameters(recurse=False) if p.grad is not None]
            sources[layer.name] = torch.cat(grads).view(torch.uint8)
            if layer.name not in hosts:
                hosts[layer.name] = torch.empty(layer.grad_bytes, dtype=torch.uint8).pin_memory()
        torch.cuda.synchronize(0)
        if step >= offload.WARMUP_STEPS:
            results.append(offload.offload(step, layers, rates, link, send))

    losses = offload.train(shape, 6, on_gradients, device="cuda:0")
    print(*offload.layer_lines(results, shape), sep="\n")
    print(f"loss {losses[0]:.3f} → {losses[-1]:.3f}; wall-clock means over the last {len(results)} steps")
    print(*offload.table(results, "ms"), sep="\n")


def main() -> int:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        print(f"no NVIDIA GPU/driver here: NVML says {exc}; run this on a GPU host")
        return 2
    started = time.perf_counter()
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            print("no NVIDIA GPU/driver here: the driver sees 0 GPUs; run this on a GPU host")
            return 2
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        driver, nvml = pynvml.nvmlSystemGetDriverVersion(), pynvml.nvmlSystemGetNVMLVersion()
        print(f"driver {driver}, CUDA {cuda // 1000}.{cuda % 1000 // 10} (driver API), NVML {nvml}")
        for index in range(count):
            print(f"GPU {index}: {pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))}")
        print()
        print_table(nvml_rows(count))
    finally:
        pynvml.nvmlShutdown()
    import torch

    has_cuda = torch.cuda.is_available()
    seen = torch.cuda.device_count() if has_cuda else 0
    print(f"\ntorch {torch.__version__}, CUDA {torch.version.cuda}, sees {seen} GPU(s)")
    collector_check(has_cuda)
    if has_cuda:
        pynvml.nvmlInit()
        try:
            pcie_check()
        finally:
            pynvml.nvmlShutdown()
        allocator_check()
    else:
        print("torch sees no CUDA device (CPU build?): allocator check skipped")
    offload_check()
    print(f"\ndone in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
