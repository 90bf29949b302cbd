"""GPU collection through NVML: the real no-driver path of this machine, and the collector's logic against
`StandInNvml`, which stands in for the NVIDIA driver and GPUs this machine lacks."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml
import pytest

from prismlb.agent._gpu import PCI_DEVICES, PCIE_WINDOW_S, GpuCollector, GpuNodeMetrics, GpuProcess
from prismlb.wire import NodeMetrics

GIB = 1 << 30
H200_LINK_BYTES_PER_S = 18 * 25e9  # NVLink 4.0, 18 links, per direction


@dataclass
class StandInGpu:
    """One scripted GPU; `unsupported` names the NVML functions that raise NotSupported for it."""

    bus_id: str
    used: int = 10 * GIB
    total: int = 141 * GIB
    util_percent: int = 0
    pcie_kbps: tuple[int, int] = (0, 0)
    links: dict[int, str] = field(default_factory=dict)  # active link -> the remote end's PCI bus id
    # (TX KiB, RX KiB, µs) per field-value read; None: that field is not supported, as it is when none is left
    counters: list[tuple[int | None, int | None, int]] = field(default_factory=list)
    # (TX bytes, RX bytes, µs) per read of the 32-bit PCIe byte counters; none left: not supported
    pcie_counters: list[tuple[int, int, int]] = field(default_factory=list)
    affinity: list[int] = field(default_factory=lambda: [0b1])
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)


class StandInNvml:
    """Stands in for NVML (no NVIDIA driver or GPU on this machine): just the functions GpuCollector calls,
    with scripted values in pynvml's own structs and errors. Handles are device indices."""

    def __init__(self, gpus: list[StandInGpu], levels: dict[tuple[int, int], int] | None = None) -> None:
        self.gpus = gpus
        self.levels = levels or {}
        self.shutdowns = 0
        self.memory_versions: list[int] = []

    def _gpu(self, handle: int, function: str) -> StandInGpu:
        gpu = self.gpus[handle]
        if function in gpu.unsupported:
            raise pynvml.NVMLError_NotSupported()
        return gpu

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "570.124.06"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-stand-in-{handle}"

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA H200 (stand-in)"

    def nvmlDeviceGetPciInfo(self, handle: int) -> pynvml.nvmlPciInfo_t:
        return pynvml.nvmlPciInfo_t(busId=self.gpus[handle].bus_id.encode())

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int) -> pynvml.c_nvmlMemory_v2_t:
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        self.memory_versions.append(version)
        return pynvml.c_nvmlMemory_v2_t(version=version, total=gpu.total, free=gpu.total - gpu.used, used=gpu.used)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> pynvml.c_nvmlUtilization_t:
        return pynvml.c_nvmlUtilization_t(gpu=self._gpu(handle, "nvmlDeviceGetUtilizationRates").util_percent)

    def nvmlDeviceGetPcieThroughput(self, handle: int, counter: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetPcieThroughput").pcie_kbps[counter]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: int) -> int:
        return 5

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: int) -> int:
        return 16

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetNvLinkState")
        if link >= 18:
            raise pynvml.NVMLError_InvalidArgument()
        return pynvml.NVML_NVLINK_STATE_ACTIVE if link in gpu.links else pynvml.NVML_NVLINK_STATE_INACTIVE

    def nvmlDeviceGetNvLinkVersion(self, handle: int, link: int) -> int:
        return pynvml.NVML_NVLINK_VERSION_4_0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: int, link: int) -> pynvml.nvmlPciInfo_t:
        return pynvml.nvmlPciInfo_t(busId=self.gpus[handle].links[link].encode())

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: int, link: int) -> int:
        return pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH

    def nvmlDeviceGetFieldValues(self, handle: int, fields: list[tuple[int, int]]) -> list[pynvml.c_nvmlFieldValue_t]:
        gpu = self._gpu(handle, "nvmlDeviceGetFieldValues")
        ids = [field_id for field_id, _scope in fields]
        if ids == [pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES]:
            *read, timestamp = gpu.pcie_counters.pop(0) if gpu.pcie_counters else (None, None, 0)
            kind = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT  # as the H200's driver reports them
        else:
            assert ids == [pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX]
            *read, timestamp = gpu.counters.pop(0) if gpu.counters else (None, None, 0)
            kind = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        values = []
        for (field_id, scope), value in zip(fields, read, strict=True):
            entry = pynvml.c_nvmlFieldValue_t(fieldId=field_id, scopeId=scope, timestamp=timestamp)
            entry.valueType = kind
            entry.nvmlReturn = pynvml.NVML_SUCCESS if value is not None else pynvml.NVML_ERROR_NOT_SUPPORTED
            if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
                entry.value.uiVal = value or 0
            else:
                entry.value.ullVal = value or 0
            values.append(entry)
        return values

    def nvmlDeviceGetNumaNodeId(self, handle: int) -> int:
        self._gpu(handle, "nvmlDeviceGetNumaNodeId")
        return 4 + handle

    def nvmlDeviceGetCpuAffinity(self, handle: int, words: int) -> list[int]:
        return self.gpus[handle].affinity

    def nvmlDeviceGetTopologyCommonAncestor(self, first: int, second: int) -> int:
        return self.levels.get((first, second), pynvml.NVML_TOPOLOGY_SYSTEM)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        processes = self.gpus[handle].processes
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in processes]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        return self.nvmlDeviceGetComputeRunningProcesses(handle)[:1]


def _open(nvml: StandInNvml) -> GpuCollector:
    collector, reason = GpuCollector.open(nvml)
    assert collector is not None, reason
    return collector


def _kib_for(ratio: float, seconds: float = 1.0) -> int:
    """KiB an H200's links carry in one direction at `ratio` of their bandwidth."""
    return round(ratio * H200_LINK_BYTES_PER_S * seconds / 1024)


def test_no_nvidia_driver_on_this_machine() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        collector, reason = GpuCollector.open()
        assert collector is None
        assert reason.startswith("no NVIDIA driver (")
        assert "): GPU dimensions stay absent; " in reason
        return
    pynvml.nvmlShutdown()
    pytest.skip("this host has an NVIDIA driver; bench/gpu_check.py exercises it")


def test_open_names_the_gpus_and_refuses_a_host_without_any() -> None:
    collector, reason = GpuCollector.open(StandInNvml([StandInGpu("00000000:18:00.0")]))
    assert collector is not None
    assert reason == "NVML: driver 570.124.06, 1 GPU(s) (0: NVIDIA H200 (stand-in))"
    empty = StandInNvml([])
    none_found = "no usable NVIDIA GPU (driver 570.124.06, 0 device(s)): GPU dimensions stay absent"
    assert GpuCollector.open(empty) == (None, none_found)
    assert empty.shutdowns == 1


def test_memory_sums_and_ratios_peak_over_devices() -> None:
    nvml = StandInNvml(
        [
            StandInGpu("00000000:18:00.0", used=30 * GIB, util_percent=35, pcie_kbps=(31_504_000, 1_000)),
            StandInGpu("00000000:2A:00.0", used=50 * GIB, util_percent=90, pcie_kbps=(0, 6_300_800)),
        ]
    )
    sample = _open(nvml).sample()
    assert nvml.memory_versions == [pynvml.nvmlMemory_v2] * 2
    assert [gpu.util_ratio for gpu in sample.devices] == [0.35, 0.9]
    # PCIe 5.0 x16: 16 lanes × 3.938 GB/s per direction; the busier direction counts
    assert [gpu.pcie_util_ratio for gpu in sample.devices] == pytest.approx([0.5, 0.1])
    node = sample.node
    assert (node.gpu_count, node.gpu_mem_used_bytes, node.gpu_mem_total_bytes) == (2, 80 * GIB, 282 * GIB)
    assert (node.gpu_util_ratio, node.pcie_util_ratio) == (0.9, pytest.approx(0.5))
    assert node.nvlink_util_ratio is None  # no active NVLink
    metrics = NodeMetrics(**dataclasses.asdict(node))
    assert metrics.gpu_mem_used_bytes == 80 * GIB


def _nvlinked(counters: list[tuple[int | None, int | None, int]], bus_id: str = "00000000:18:00.0") -> StandInGpu:
    """A GPU whose 18 links all end in one NVSwitch, with scripted data counters."""
    return StandInGpu(bus_id, links={link: "00000000:99:00.0" for link in range(18)}, counters=counters)


def test_nvlink_utilisation_from_counter_deltas() -> None:
    base = 7_000_000_000
    gpu = _nvlinked(
        [
            (base, base, 1_000_000),
            (base + _kib_for(0.25, 3), base + _kib_for(0.6, 3), 4_000_000),  # 3 s later: RX is busier
            (base + _kib_for(0.25, 3), base + _kib_for(0.6, 3), 5_000_000),  # idle second
        ]
    )
    collector = _open(StandInNvml([gpu]))
    assert collector.sample().devices[0].nvlink_util_ratio is None  # no delta yet
    second = collector.sample()
    assert second.devices[0].nvlink_util_ratio == pytest.approx(0.6, abs=1e-6)
    assert second.node.nvlink_util_ratio == pytest.approx(0.6, abs=1e-6)
    assert collector.sample().devices[0].nvlink_util_ratio == 0.0  # measured idle: 0, not absent


def test_nvlink_counter_wrap_is_a_delta_and_a_reset_skips_the_interval(caplog: pytest.LogCaptureFixture) -> None:
    gpu = _nvlinked(
        [
            ((1 << 64) - _kib_for(0.3, 2), 1_000, 0),
            (_kib_for(0.4, 2), 1_000 + _kib_for(0.2, 2), 2_000_000),  # TX passed 2**64: 0.7 of 2 s of bandwidth
            (5, 7, 3_000_000),  # driver reset: both counters back near 0
            (5 + _kib_for(0.5), 7, 4_000_000),  # measured again from the new baseline
        ]
    )
    collector = _open(StandInNvml([gpu]))
    collector.sample()
    assert collector.sample().devices[0].nvlink_util_ratio == pytest.approx(0.7, abs=1e-6)
    with caplog.at_level(logging.INFO, logger="prism.agent.gpu"):
        assert collector.sample().devices[0].nvlink_util_ratio is None
    assert caplog.messages == ["GPU 0: nvlink interval absent (counter went backwards or clock stood still: skipped)"]
    assert collector.sample().devices[0].nvlink_util_ratio == pytest.approx(0.5, abs=1e-6)


def test_unsupported_readings_are_absent_not_zero_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    unsupported = {"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPcieThroughput", "nvmlDeviceGetNumaNodeId"}
    gpus = [
        StandInGpu("00000000:18:00.0", unsupported=unsupported),
        _nvlinked([(None, 1, 0), (None, 2, 1_000_000)], "00000000:3B:00.0"),  # TX field not supported
        StandInGpu("00000000:2A:00.0", unsupported={"nvmlDeviceGetMemoryInfo"}),
    ]
    collector = _open(StandInNvml(gpus))
    with caplog.at_level(logging.INFO, logger="prism.agent.gpu"):
        first = collector.sample()
        second = collector.sample()
    for sample in (first, second):
        assert [gpu.index for gpu in sample.devices] == [0, 1]  # GPU 2's memory is unreadable
        plain, linked = sample.devices
        assert (plain.util_ratio, plain.pcie_util_ratio, plain.nvlink_util_ratio) == (None, None, None)
        assert linked.nvlink_util_ratio is None
        assert sample.node.gpu_util_ratio == 0.0  # GPU 1 reported 0 %; GPU 0 is absent, not 0
        assert sample.node.nvlink_util_ratio is None
    lines = caplog.messages
    assert lines.count("GPU 0: utilisation absent (Not Supported)") == 1
    assert lines.count("GPU 1: nvlink throughput absent (Not Supported)") == 1
    assert lines.count("GPU 2: memory absent (Not Supported)") == 1
    assert [device.memory_numa_node for device in collector.topology().devices] == [None, 5, 6]
    unreadable = _open(StandInNvml([gpus[2]])).sample()
    assert (unreadable.devices, unreadable.node) == ([], GpuNodeMetrics())


def test_nvlink_peers_match_remote_pci_bus_ids_and_share_an_nvswitch() -> None:
    switch = "00000000:C5:00.0"
    gpus = [
        StandInGpu("00000000:18:00.0", links={0: "00000000:2A:00.0", 1: "00000000:2a:00.0"}),
        StandInGpu("00000000:2A:00.0", links={0: "00000000:18:00.0"}),
        StandInGpu("00000001:3B:00.0", links={link: switch for link in range(18)}),
        StandInGpu("00000001:4C:00.0", links={link: switch for link in range(18)}),
        StandInGpu("00000000:5D:00.0", links={0: ""}),  # no bus id for the far end: its device type decides
        StandInGpu("00000000:6E:00.0"),
    ]
    collector = _open(StandInNvml(gpus))
    topology = collector.topology()
    assert [device.nvlink_peers for device in topology.devices] == [(1,), (0,), (3, 4), (2, 4), (2, 3), ()]
    assert [device.nvswitch for device in topology.devices] == [False, False, True, True, True, False]
    assert [device.pci_bus_id for device in topology.devices][2] == "0001:3b:00.0"
    assert [gpu.nvlink_peers for gpu in collector.sample().devices] == [[1], [0], [3, 4], [2, 4], [2, 3], []]


def _numa_node(pci: str) -> int:
    path = PCI_DEVICES / pci / "numa_node"
    return int(path.read_text()) if path.exists() else -1


def test_topology_levels_affinity_and_numa_from_sysfs() -> None:
    """NUMA comes from a real PCI device of this machine, one on a NUMA node where there is one."""
    present = sorted(path.name for path in PCI_DEVICES.iterdir()) if PCI_DEVICES.is_dir() else ["0000:00:00.0"]
    pci = max(present, key=lambda name: _numa_node(name) >= 0)
    domain, bus, device = pci.split(":")
    levels = {
        (0, 1): pynvml.NVML_TOPOLOGY_SINGLE,
        (0, 2): pynvml.NVML_TOPOLOGY_NODE,
        (1, 2): pynvml.NVML_TOPOLOGY_SYSTEM,
    }
    gpus = [
        StandInGpu(f"{int(domain, 16):08X}:{bus.upper()}:{device.upper()}", affinity=[0b1011, 0b1]),
        StandInGpu("00000000:FE:00.0"),  # no such PCI device on this machine
        StandInGpu("00000000:FF:00.0", affinity=[0, 0]),
    ]
    topology = _open(StandInNvml(gpus, levels)).topology()
    assert topology.common_ancestor == {(0, 1): "PIX", (0, 2): "NODE", (1, 2): "SYS"}
    assert [device.cpu_affinity for device in topology.devices] == [(0, 1, 3, 64), (0,), ()]
    expected = _numa_node(pci)
    assert topology.devices[0].numa_node == (expected if expected >= 0 else None)
    assert topology.devices[1].numa_node is None


def test_processes_per_gpu_once_with_unknown_memory_absent() -> None:
    gpus = [
        StandInGpu("00000000:18:00.0", processes=[(4242, 20 * GIB), (4343, None)]),
        StandInGpu("00000000:2A:00.0", processes=[(4242, GIB)]),
    ]
    assert _open(StandInNvml(gpus)).processes() == [
        GpuProcess(0, 4242, 20 * GIB),
        GpuProcess(0, 4343, None),
        GpuProcess(1, 4242, GIB),
    ]


PCIE5_X16_BYTES_PER_S = 16 * 3.938e9  # per direction


def test_pcie_utilisation_from_32_bit_byte_counters_over_one_shared_window(caplog: pytest.LogCaptureFixture) -> None:
    """Both GPUs' byte counters are read, then one wait for the pair, then read again; the busier direction over
    the link's bandwidth, a 32-bit wrap included; nvmlDeviceGetPcieThroughput (blocking) is not called."""
    window_us = 20_000

    def reads(tx_ratio: float, rx_ratio: float, tx0: int, rx0: int, at: int) -> list[tuple[int, int, int]]:
        moved = [round(ratio * PCIE5_X16_BYTES_PER_S * window_us / 1e6) for ratio in (tx_ratio, rx_ratio)]
        return [(tx0, rx0, at), ((tx0 + moved[0]) % (1 << 32), (rx0 + moved[1]) % (1 << 32), at + window_us)]

    busy = StandInGpu(
        "00000000:18:00.0",
        pcie_counters=reads(0.05, 0.9, 7, (1 << 32) - 10_000, 0)  # RX wraps within the window
        + [(100, 100, 50_000_000), (50, 100, 50_020_000)]  # TX went backwards (driver reset): skipped
        + reads(0.0, 0.0, 50, 100, 60_000_000),
        unsupported={"nvmlDeviceGetPcieThroughput"},
    )
    quiet = StandInGpu("00000000:2A:00.0", pcie_counters=reads(0.3, 0.1, 5, 5, 0) * 3)
    quiet.unsupported = {"nvmlDeviceGetPcieThroughput"}
    waits: list[float] = []
    collector, reason = GpuCollector.open(StandInNvml([busy, quiet]), sleep=waits.append)
    assert collector is not None, reason
    first = collector.sample()
    assert waits == [PCIE_WINDOW_S]  # one wait for both devices
    assert [gpu.pcie_util_ratio for gpu in first.devices] == pytest.approx([0.9, 0.3], abs=1e-6)
    assert first.node.pcie_util_ratio == pytest.approx(0.9, abs=1e-6)
    with caplog.at_level(logging.INFO, logger="prism.agent.gpu"):
        reset = collector.sample()
    assert [gpu.pcie_util_ratio for gpu in reset.devices][0] is None
    assert caplog.messages == ["GPU 0: pcie interval absent (counter went backwards or clock stood still: skipped)"]
    assert [gpu.pcie_util_ratio for gpu in collector.sample().devices] == pytest.approx([0.0, 0.3], abs=1e-6)
    assert len(waits) == 3


def test_pcie_falls_back_to_throughput_without_counters_and_waits_for_none() -> None:
    waits: list[float] = []
    gpu = StandInGpu("00000000:18:00.0", pcie_kbps=(0, 31_504_000))
    collector, reason = GpuCollector.open(StandInNvml([gpu]), sleep=waits.append)
    assert collector is not None, reason
    assert collector.sample().devices[0].pcie_util_ratio == pytest.approx(0.5)
    assert waits == []


def test_close_shuts_nvml_down_once() -> None:
    nvml = StandInNvml([StandInGpu("00000000:18:00.0")])
    with _open(nvml) as collector:
        collector.close()
    assert nvml.shutdowns == 1
