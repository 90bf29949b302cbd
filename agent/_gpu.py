"""GPU state through NVML (nvidia-ml-py): memory, utilisation, NVLink and PCIe load, per-process memory and
topology. A reading the driver or device does not support is absent (None), never 0."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pynvml

from prismlb.wire import GpuState

_log = logging.getLogger("prism.agent.gpu")

PCI_DEVICES = Path("/sys/bus/pci/devices")
ALL_LINKS = 0xFFFF_FFFF  # field-value scope: the sum over every NVLink link (UINT_MAX)
_NVLINK_FIELDS = [
    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
]
_LINK_UP = {pynvml.NVML_NVLINK_STATE_ACTIVE, pynvml.NVML_NVLINK_STATE_SLEEP}  # a sleeping link wakes on traffic
_PCIE_FIELDS = [(pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0), (pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0)]
# The PCIe byte counters are 32 bits wide on the H200s measured (bench/gpu_check.py): at 60 GB/s they wrap every
# 72 ms, so they are read twice this far apart (all devices within one wait), the window nvmlDeviceGetPcieThroughput
# counts over too, which blocks about as long per call and direction.
PCIE_WINDOW_S = 0.02
_KIB = 1024
_PCIE_KB = 1000  # nvmlDeviceGetPcieThroughput reports KB/s
_GB = 1e9
# A counter delta above this multiple of the links' capacity is no traffic the links could carry: the counter
# went backwards (driver reset) and the unsigned difference wrapped, so the interval is skipped.
_PLAUSIBLE = 1.5

# NVLink data bandwidth per link and direction in GB/s by nvmlDeviceGetNvLinkVersion: NVIDIA's per-GPU totals
# (both directions) over the generation's link count: 1.0 P100 160 GB/s / 4 links; 2.0 V100 300 / 6;
# 2.2 Turing 100 / 2; 3.0 A100 600 / 12; 3.1 GA10x bridge 112.5 / 4; 4.0 H100/H200 900 / 18; 5.0 B200 1800 / 18.
# Another version leaves NVLink utilisation absent.
NVLINK_GBPS_PER_LINK: dict[int, float] = {
    pynvml.NVML_NVLINK_VERSION_1_0: 20.0,
    pynvml.NVML_NVLINK_VERSION_2_0: 25.0,
    pynvml.NVML_NVLINK_VERSION_2_2: 25.0,
    pynvml.NVML_NVLINK_VERSION_3_0: 25.0,
    pynvml.NVML_NVLINK_VERSION_3_1: 14.0625,
    pynvml.NVML_NVLINK_VERSION_4_0: 25.0,
    pynvml.NVML_NVLINK_VERSION_5_0: 50.0,
}
# PCIe data bandwidth per lane and direction in GB/s by generation, after line encoding (8b/10b for 1-2,
# 128b/130b for 3-5, FLIT 242/256 for 6), the denominator of PCIe utilisation with the maximum link width.
PCIE_GBPS_PER_LANE: dict[int, float] = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
# nvmlDeviceGetTopologyCommonAncestor levels as `nvidia-smi topo -m` names them.
TOPOLOGY_LEVELS: dict[int, str] = {
    pynvml.NVML_TOPOLOGY_INTERNAL: "INTERNAL",
    pynvml.NVML_TOPOLOGY_SINGLE: "PIX",
    pynvml.NVML_TOPOLOGY_MULTIPLE: "PXB",
    pynvml.NVML_TOPOLOGY_HOSTBRIDGE: "PHB",
    pynvml.NVML_TOPOLOGY_NODE: "NODE",
    pynvml.NVML_TOPOLOGY_SYSTEM: "SYS",
}
_COUNTER_BITS = {
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: ("uiVal", 32),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: ("ulVal", 64),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: ("ullVal", 64),
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: ("sllVal", 64),
}
_INIT_FAILURES: dict[type[pynvml.NVMLError], tuple[str, str]] = {
    pynvml.NVMLError_LibraryNotFound: ("no NVIDIA driver", "install the NVIDIA driver (libnvidia-ml.so.1)"),
    pynvml.NVMLError_DriverNotLoaded: ("no NVIDIA driver", "load the kernel module (modprobe nvidia)"),
    pynvml.NVMLError_NoPermission: ("NVML refused", "give the agent's user access to /dev/nvidia*"),
}


class GpuProcess(NamedTuple):
    """A process with memory on a GPU; `used_bytes` is None where the driver does not say (WDDM, MIG)."""

    gpu_index: int
    pid: int
    used_bytes: int | None


@dataclass(frozen=True)
class GpuNodeMetrics:
    """The node's GPUs under NodeMetrics field names: memory summed, utilisation at the busiest device;
    `dataclasses.asdict` gives NodeMetrics keyword arguments."""

    gpu_count: int | None = None
    gpu_mem_used_bytes: int | None = None
    gpu_mem_total_bytes: int | None = None
    gpu_util_ratio: float | None = None
    nvlink_util_ratio: float | None = None
    pcie_util_ratio: float | None = None


@dataclass(frozen=True)
class GpuSample:
    """Every readable GPU now and the node's aggregates over them."""

    devices: list[GpuState]
    node: GpuNodeMetrics


@dataclass(frozen=True)
class DeviceTopology:
    """Where one GPU sits: `numa_node` is the host NUMA node of its PCI device (sysfs; None on a one-node host),
    `memory_numa_node` the NUMA node its own memory forms on coherent platforms such as Grace Hopper
    (nvmlDeviceGetNumaNodeId), `nvlink_peers` the local GPUs it reaches over NVLink, directly or through an
    NVSwitch (`nvswitch`)."""

    index: int
    pci_bus_id: str
    numa_node: int | None
    memory_numa_node: int | None
    cpu_affinity: tuple[int, ...]
    nvlink_peers: tuple[int, ...]
    nvswitch: bool


@dataclass(frozen=True)
class GpuTopology:
    """Per-device placement and, for each pair (i, j) with i < j, their closest common PCIe ancestor."""

    devices: tuple[DeviceTopology, ...]
    common_ancestor: dict[tuple[int, int], str]


@dataclass(frozen=True)
class _Reading:
    """One cumulative counter value (KiB for NVLink, bytes for PCIe), NVML's timestamp of it (µs) and the value
    past which it wraps."""

    value: int
    timestamp_us: int
    modulus: int


@dataclass
class _Device:
    index: int
    handle: Any
    uuid: str
    name: str
    pci_bus_id: str
    nvlink_links: list[int]
    nvlink_bytes_per_s: float | None  # per direction, over the active links
    pcie_bytes_per_s: float | None  # per direction, at the maximum link generation and width
    counters: tuple[_Reading, _Reading] | None = None


def _sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's `00000000:3B:00.0` as sysfs names it: `0000:3b:00.0` (anything else lower-cased)."""
    try:
        domain, bus, device = nvml_bus_id.split(":")
        return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}"
    except ValueError:
        return nvml_bus_id.lower()


def _pci_numa_node(bus_id: str) -> int | None:
    try:
        node = int((PCI_DEVICES / bus_id / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _cpus(masks: Sequence[int]) -> tuple[int, ...]:
    """The CPUs set in NVML's affinity bitmask, 64 CPUs per word."""
    return tuple(word * 64 + bit for word, mask in enumerate(masks) for bit in range(64) if mask >> bit & 1)


def _rate(previous: _Reading, current: _Reading, limit_per_s: float) -> float | None:
    """Counter units per second between two readings, an unsigned wrap included; None when the clock did not
    advance or the delta exceeds `limit_per_s` (the counter went backwards, so the interval is skipped)."""
    elapsed_s = (current.timestamp_us - previous.timestamp_us) / 1e6
    if elapsed_s <= 0:
        return None
    rate = (current.value - previous.value) % current.modulus / elapsed_s
    return rate if rate <= limit_per_s else None


def _highest(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return max(present) if present else None


def _node_metrics(devices: Sequence[GpuState]) -> GpuNodeMetrics:
    """Memory summed and utilisation ratios at their maximum over `devices`; all absent without devices."""
    if not devices:
        return GpuNodeMetrics()
    return GpuNodeMetrics(
        gpu_count=len(devices),
        gpu_mem_used_bytes=sum(device.mem_used_bytes for device in devices),
        gpu_mem_total_bytes=sum(device.mem_total_bytes for device in devices),
        gpu_util_ratio=_highest([device.util_ratio for device in devices]),
        nvlink_util_ratio=_highest([device.nvlink_util_ratio for device in devices]),
        pcie_util_ratio=_highest([device.pcie_util_ratio for device in devices]),
    )


class GpuCollector:
    """Reads every GPU of this host through NVML; `nvml` is the pynvml module (or a stand-in for it), `sleep` waits
    out the PCIe counters' window."""

    def __init__(self, nvml: Any, sleep: Callable[[float], None] = time.sleep) -> None:
        self._nvml = nvml
        self._sleep = sleep
        self._logged: set[tuple[int, str, str]] = set()
        self._devices: list[_Device] = []
        self._numa: dict[int, int | None] = {}
        self._peers: dict[int, list[int]] = {}
        self._closed = False

    @classmethod
    def open(cls, nvml: Any = pynvml, sleep: Callable[[float], None] = time.sleep) -> tuple[GpuCollector | None, str]:
        """A collector over every GPU NVML shows and a line saying what it found, or None and one line saying
        why not and how to fix it."""
        try:
            nvml.nvmlInit()
        except pynvml.NVMLError as exc:
            what, fix = _INIT_FAILURES.get(type(exc), ("NVML unavailable", "check nvidia-smi on this host"))
            return None, f"{what} ({exc}): GPU dimensions stay absent; {fix}"
        collector = cls(nvml, sleep)
        try:
            driver = nvml.nvmlSystemGetDriverVersion()
            count = nvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            collector.close()
            return None, f"NVML failed ({exc}): GPU dimensions stay absent; check nvidia-smi on this host"
        collector._devices = [device for index in range(count) if (device := collector._open_device(index))]
        if not collector._devices:
            collector.close()
            return None, f"no usable NVIDIA GPU (driver {driver}, {count} device(s)): GPU dimensions stay absent"
        topology = collector.topology()
        collector._numa = {device.index: device.numa_node for device in topology.devices}
        collector._peers = {device.index: list(device.nvlink_peers) for device in topology.devices}
        names = ", ".join(f"{device.index}: {device.name}" for device in collector._devices)
        return collector, f"NVML: driver {driver}, {len(collector._devices)} GPU(s) ({names})"

    def _read(self, index: int, field: str, call: Callable[..., Any], *args: Any) -> Any:
        """`call(*args)`, or None (the field absent) when NVML raises; logged once per device, field and error."""
        try:
            return call(*args)
        except pynvml.NVMLError as exc:
            self._absent(index, field, exc)
            return None

    def _absent(self, index: int, field: str, reason: object) -> None:
        key = (index, field, str(reason))
        if key not in self._logged:
            self._logged.add(key)
            unexpected = isinstance(reason, pynvml.NVMLError) and not isinstance(reason, pynvml.NVMLError_NotSupported)
            level = logging.WARNING if unexpected else logging.INFO
            _log.log(level, "GPU %d: %s absent (%s)", index, field, reason)

    def _open_device(self, index: int) -> _Device | None:
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid, name = nvml.nvmlDeviceGetUUID(handle), nvml.nvmlDeviceGetName(handle)
            bus_id = _sysfs_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
        except pynvml.NVMLError as exc:
            _log.warning("GPU %d skipped: %s", index, exc)
            return None
        links = self._active_links(index, handle)
        generation = self._read(index, "pcie generation", nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
        width = self._read(index, "pcie width", nvml.nvmlDeviceGetMaxPcieLinkWidth, handle)
        lane = PCIE_GBPS_PER_LANE.get(generation) if generation is not None else None
        return _Device(
            index=index,
            handle=handle,
            uuid=uuid,
            name=name,
            pci_bus_id=bus_id,
            nvlink_links=links,
            nvlink_bytes_per_s=self._nvlink_capacity(index, handle, links),
            pcie_bytes_per_s=lane * width * _GB if lane is not None and width else None,
        )

    def _active_links(self, index: int, handle: Any) -> list[int]:
        """The device's links that are up (active or asleep), stopping at the first link it does not have."""
        links: list[int] = []
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                state = self._nvml.nvmlDeviceGetNvLinkState(handle, link)
            except pynvml.NVMLError_InvalidArgument:
                break  # past the device's last link
            except pynvml.NVMLError as exc:
                self._absent(index, "nvlink state", exc)
                continue
            if state in _LINK_UP:
                links.append(link)
        return links

    def _nvlink_capacity(self, index: int, handle: Any, links: list[int]) -> float | None:
        if not links:
            self._absent(index, "nvlink utilisation", "no active NVLink link")
            return None
        version = self._read(index, "nvlink version", self._nvml.nvmlDeviceGetNvLinkVersion, handle, links[0])
        per_link = NVLINK_GBPS_PER_LINK.get(version) if version is not None else None
        if per_link is None:
            self._absent(index, "nvlink utilisation", f"NVLink version {version} has no bandwidth in the table")
            return None
        return len(links) * per_link * _GB

    def sample(self) -> GpuSample:
        """Every device's state now and the node's aggregates; a device whose memory NVML cannot read is left out."""
        pcie = self._pcie_ratios()
        devices = [state for device in self._devices if (state := self._state(device, pcie)) is not None]
        return GpuSample(devices=devices, node=_node_metrics(devices))

    def _state(self, device: _Device, pcie: dict[int, float | None]) -> GpuState | None:
        nvml, index, handle = self._nvml, device.index, device.handle
        memory = self._read(index, "memory", nvml.nvmlDeviceGetMemoryInfo, handle, pynvml.nvmlMemory_v2)
        if memory is None:
            return None
        rates = self._read(index, "utilisation", nvml.nvmlDeviceGetUtilizationRates, handle)
        return GpuState(
            index=index,
            uuid=device.uuid,
            name=device.name,
            mem_used_bytes=memory.used,
            mem_total_bytes=memory.total,
            util_ratio=min(1.0, rates.gpu / 100) if rates is not None else None,
            nvlink_util_ratio=self._nvlink_ratio(device),
            pcie_util_ratio=pcie.get(index),
            numa_node=self._numa.get(index),
            nvlink_peers=self._peers.get(index, []),
        )

    def _pcie_ratios(self) -> dict[int, float | None]:
        """Each device's busier PCIe direction over the link's maximum bandwidth, in `PCIE_WINDOW_S`: from the byte
        counters read before and after one wait shared by every device, or, where the driver lacks them, from
        nvmlDeviceGetPcieThroughput (the same window, but one blocking call per device and direction)."""
        measured = [device for device in self._devices if device.pcie_bytes_per_s is not None]
        first = {device.index: self._counters(device, "pcie counters", _PCIE_FIELDS) for device in measured}
        if any(first.values()):
            self._sleep(PCIE_WINDOW_S)
        ratios: dict[int, float | None] = {}
        for device in measured:
            before = first[device.index]
            ratios[device.index] = (
                self._throughput_ratio(device) if before is None else self._pcie_counter_ratio(device, before)
            )
        return ratios

    def _pcie_counter_ratio(self, device: _Device, before: tuple[_Reading, _Reading]) -> float | None:
        capacity = device.pcie_bytes_per_s
        after = self._counters(device, "pcie counters", _PCIE_FIELDS)
        if after is None or capacity is None:
            return None
        tx, rx = (_rate(then, now, capacity * _PLAUSIBLE) for then, now in zip(before, after, strict=True))
        if tx is None or rx is None:
            self._absent(device.index, "pcie interval", "counter went backwards or clock stood still: skipped")
            return None
        return min(1.0, max(tx, rx) / capacity)

    def _throughput_ratio(self, device: _Device) -> float | None:
        """The busier direction's throughput (NVML counts it over 20 ms) over the link's maximum bandwidth."""
        if device.pcie_bytes_per_s is None:
            return None
        read, index, handle = self._nvml.nvmlDeviceGetPcieThroughput, device.index, device.handle
        tx = self._read(index, "pcie tx throughput", read, handle, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = self._read(index, "pcie rx throughput", read, handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
        if tx is None or rx is None:
            return None
        return min(1.0, max(tx, rx) * _PCIE_KB / device.pcie_bytes_per_s)

    def _nvlink_ratio(self, device: _Device) -> float | None:
        """The busier direction's data throughput since the last sample over the active links' bandwidth."""
        if device.nvlink_bytes_per_s is None:
            return None
        counters = self._counters(device, "nvlink throughput", _NVLINK_FIELDS)
        previous, device.counters = device.counters, counters
        if counters is None or previous is None:
            return None
        limit = device.nvlink_bytes_per_s * _PLAUSIBLE / _KIB
        tx, rx = (_rate(before, now, limit) for before, now in zip(previous, counters, strict=True))
        if tx is None or rx is None:
            self._absent(device.index, "nvlink interval", "counter went backwards or clock stood still: skipped")
            return None
        return min(1.0, max(tx, rx) * _KIB / device.nvlink_bytes_per_s)

    def _counters(self, device: _Device, name: str, fields: list[tuple[int, int]]) -> tuple[_Reading, _Reading] | None:
        """The cumulative TX and RX counters `fields` names (NVLink data in KiB over all links, or PCIe bytes) from
        field values; None, logged once as `name`, where the driver lacks either."""
        values = self._read(device.index, name, self._nvml.nvmlDeviceGetFieldValues, device.handle, fields)
        if values is None:
            return None
        readings: list[_Reading] = []
        for value in values:
            if value.nvmlReturn != pynvml.NVML_SUCCESS:
                self._absent(device.index, name, pynvml.NVMLError(value.nvmlReturn))
                return None
            if value.valueType not in _COUNTER_BITS:
                self._absent(device.index, name, f"value type {value.valueType} is no counter")
                return None
            member, bits = _COUNTER_BITS[value.valueType]
            readings.append(_Reading(getattr(value.value, member), value.timestamp, 1 << bits))
        return readings[0], readings[1]

    def processes(self) -> list[GpuProcess]:
        """Compute and graphics processes with memory on each GPU (host pids), each (GPU, pid) once."""
        nvml = self._nvml
        found: list[GpuProcess] = []
        for device in self._devices:
            seen: set[int] = set()
            for kind, call in (
                ("compute processes", nvml.nvmlDeviceGetComputeRunningProcesses),
                ("graphics processes", nvml.nvmlDeviceGetGraphicsRunningProcesses),
            ):
                for process in self._read(device.index, kind, call, device.handle) or []:
                    if process.pid not in seen:
                        seen.add(process.pid)
                        found.append(GpuProcess(device.index, process.pid, process.usedGpuMemory))
        return found

    def topology(self) -> GpuTopology:
        """NUMA nodes, CPU affinity, NVLink peers (by the remote end's PCI bus id) and pairwise PCIe ancestors."""
        by_bus = {device.pci_bus_id: device.index for device in self._devices}
        remote = {device.index: self._remote_ends(device, by_bus) for device in self._devices}
        switched = {index for index, (_peers, nvswitch) in remote.items() if nvswitch}
        words = max(1, -(-(os.cpu_count() or 1) // 64))
        devices: list[DeviceTopology] = []
        for device in self._devices:
            nvml, index, handle = self._nvml, device.index, device.handle
            peers, nvswitch = remote[index]
            masks = self._read(index, "cpu affinity", nvml.nvmlDeviceGetCpuAffinity, handle, words)
            devices.append(
                DeviceTopology(
                    index=index,
                    pci_bus_id=device.pci_bus_id,
                    numa_node=_pci_numa_node(device.pci_bus_id),
                    memory_numa_node=self._read(index, "memory numa node", nvml.nvmlDeviceGetNumaNodeId, handle),
                    cpu_affinity=_cpus(masks) if masks is not None else (),
                    nvlink_peers=tuple(sorted(((peers | switched) if nvswitch else peers) - {index})),
                    nvswitch=nvswitch,
                )
            )
        ancestors: dict[tuple[int, int], str] = {}
        for position, first in enumerate(self._devices):
            for second in self._devices[position + 1 :]:
                level = self._read(
                    first.index,
                    "common ancestor",
                    self._nvml.nvmlDeviceGetTopologyCommonAncestor,
                    first.handle,
                    second.handle,
                )
                if level is not None:
                    ancestors[(first.index, second.index)] = TOPOLOGY_LEVELS.get(level, str(level))
        return GpuTopology(devices=tuple(devices), common_ancestor=ancestors)

    def _remote_ends(self, device: _Device, by_bus: dict[str, int]) -> tuple[set[int], bool]:
        """Local GPUs at the far end of the device's active links, and whether a link ends in an NVSwitch."""
        nvml, index, handle = self._nvml, device.index, device.handle
        peers: set[int] = set()
        nvswitch = False
        for link in device.nvlink_links:
            pci = self._read(index, "nvlink remote", nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
            if pci is None:
                continue
            peer = by_bus.get(_sysfs_bus_id(pci.busId))
            if peer is not None:
                peers.add(peer)
                continue
            kind = self._read(index, "nvlink remote type", nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
            nvswitch = nvswitch or kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
        return peers, nvswitch

    def close(self) -> None:
        """Shut NVML down (once)."""
        if not self._closed:
            self._closed = True
            self._nvml.nvmlShutdown()

    def __enter__(self) -> GpuCollector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
