"""The qnn-net-run tool: finding the QAIRT / QNN SDK and ``adb``, the command line, local and device runs.

For users with the QAIRT / QNN SDK (and, for device runs, ``adb`` and a Snapdragon device). Without
them :func:`find_sdk` / :func:`find_adb` raise :class:`~ivq_debug.errors.ToolNotFoundError` (exit 5).
The files the tool reads and writes are :mod:`ivq_debug.capture.qnn_net_run.io`'s business.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ivq_debug.capture.qnn_net_run.io import InputList
from ivq_debug.errors import InputError, ToolNotFoundError, UsageError

PROFILING_LEVELS = ("basic", "detailed", "backend", "client")
OUTPUT_DATA_TYPES = ("float_only", "native_only", "float_and_native")
BACKENDS = {"htp": "libQnnHtp.so", "cpu": "libQnnCpu.so", "gpu": "libQnnGpu.so", "dsp": "libQnnDsp.so",
            "saver": "libQnnSaver.so"}
HOST_PLATFORM = "x86_64-linux-clang"
DEVICE_PLATFORM = "aarch64-android"


# ============================================================================ SDK / tools
@dataclass(frozen=True)
class QnnSdk:
    """Where qnn-net-run and the backend libraries are."""

    net_run: Path
    root: Path | None = None
    platform: str = HOST_PLATFORM

    def lib_dir(self, platform: str | None = None) -> Path | None:
        """``<root>/lib/<platform>``, when the SDK root is known."""
        return self.root / "lib" / (platform or self.platform) if self.root else None

    def bin_dir(self, platform: str | None = None) -> Path | None:
        """``<root>/bin/<platform>``, when the SDK root is known."""
        return self.root / "bin" / (platform or self.platform) if self.root else None

    def backend_lib(self, backend: str, platform: str | None = None) -> str:
        """Path of a backend library (``htp`` → ``…/libQnnHtp.so``), or its bare name when unknown."""
        name = BACKENDS.get(backend, backend)
        d = self.lib_dir(platform)
        if d is not None and (d / name).exists():
            return str(d / name)
        return name


def find_sdk(net_run: str | os.PathLike | None = None, platform: str = HOST_PLATFORM) -> QnnSdk:
    """Locate ``qnn-net-run``: an explicit path, then ``$QNN_SDK_ROOT`` / ``$QAIRT_SDK_ROOT``, then ``PATH``.

    Raises:
        ToolNotFoundError: nothing found (exit 5).
    """
    if net_run is not None:
        p = Path(net_run)
        if p.is_file() and os.access(p, os.X_OK):
            return QnnSdk(p, _root_of(p), platform)
        raise ToolNotFoundError(f"qnn-net-run not found or not executable at {p}")
    for var in ("QNN_SDK_ROOT", "QAIRT_SDK_ROOT"):
        root = os.environ.get(var)
        if root:
            p = Path(root) / "bin" / platform / "qnn-net-run"
            if p.is_file() and os.access(p, os.X_OK):
                return QnnSdk(p, Path(root), platform)
    w = shutil.which("qnn-net-run")
    if w:
        return QnnSdk(Path(w), _root_of(Path(w)), platform)
    raise ToolNotFoundError(
        "qnn-net-run not found: install the QAIRT / QNN SDK and set QNN_SDK_ROOT (or put qnn-net-run on PATH)"
    )


def _root_of(net_run: Path) -> Path | None:
    # <root>/bin/<platform>/qnn-net-run
    parts = net_run.resolve().parts
    if len(parts) >= 4 and parts[-3] == "bin":
        return Path(*parts[:-3])
    return None


def find_adb(adb: str | os.PathLike | None = None) -> Path:
    """Locate ``adb`` (explicit path, ``$ADB``, ``PATH``).

    Raises:
        ToolNotFoundError: not found (exit 5).
    """
    for cand in (adb, os.environ.get("ADB")):
        if cand:
            p = Path(cand)
            if p.is_file() and os.access(p, os.X_OK):
                return p
            raise ToolNotFoundError(f"adb not found or not executable at {p}")
    w = shutil.which("adb")
    if not w:
        raise ToolNotFoundError("adb not found: install Android platform-tools (or set ADB) to run on a device")
    return Path(w)


# ============================================================================ command line
@dataclass
class NetRunSpec:
    """One qnn-net-run invocation (see ``qnn-net-run --help``).

    Exactly one of ``model`` (``libQnnModel.so``, comma list for several graphs) and
    ``retrieve_context`` (context binary) is required; ``dlc_path`` goes with ``model=libQnnModelDlc.so``.
    """

    backend: str
    input_list: str | os.PathLike
    output_dir: str | os.PathLike
    model: str | os.PathLike | None = None
    retrieve_context: str | os.PathLike | None = None
    dlc_path: str | os.PathLike | None = None
    debug: bool = False
    profiling_level: str | None = None
    profiling_option: str | None = None
    native_output: bool = False
    output_data_type: str | None = None
    native_input: bool = False
    native_input_tensor_names: Sequence[str] = ()
    config_file: str | os.PathLike | None = None
    log_level: str | None = None
    num_inferences: int | None = None
    perf_profile: str | None = None
    set_output_tensors: Sequence[str] = ()
    extra_args: Sequence[str] = ()

    def validate(self) -> None:
        """Check the flag combinations qnn-net-run refuses.

        Raises:
            UsageError: a forbidden combination or a bad value.
        """
        if (self.model is None) == (self.retrieve_context is None):
            raise UsageError("give exactly one of model= (a .so) and retrieve_context= (a context binary)")
        if self.retrieve_context is not None and self.debug:
            raise UsageError("--debug cannot be used with --retrieve_context (a context binary has no intermediates)")
        if self.retrieve_context is not None and self.set_output_tensors:
            raise UsageError("--set_output_tensors cannot be used with --retrieve_context")
        if self.profiling_level is not None and self.profiling_level not in PROFILING_LEVELS:
            raise UsageError(f"profiling_level must be one of {PROFILING_LEVELS}, got {self.profiling_level!r}")
        if self.output_data_type is not None:
            if self.output_data_type not in OUTPUT_DATA_TYPES:
                raise UsageError(f"output_data_type must be one of {OUTPUT_DATA_TYPES}")
            if self.native_output:
                raise UsageError("give native_output or output_data_type, not both")
        if self.num_inferences is not None and self.num_inferences < 1:
            raise UsageError("num_inferences must be >= 1")


def build_command(spec: NetRunSpec, net_run: str | os.PathLike = "qnn-net-run", sdk: QnnSdk | None = None) -> list[str]:
    """The qnn-net-run argv for ``spec`` (validated first).

    ``spec.backend`` may be a library path or a short name (``htp``, ``cpu``, ``gpu``), resolved
    through ``sdk`` when given.
    """
    spec.validate()
    backend = sdk.backend_lib(spec.backend) if sdk else BACKENDS.get(spec.backend, spec.backend)
    argv = [os.fspath(net_run), "--backend", backend]
    if spec.model is not None:
        argv += ["--model", os.fspath(spec.model)]
    if spec.dlc_path is not None:
        argv += ["--dlc_path", os.fspath(spec.dlc_path)]
    if spec.retrieve_context is not None:
        argv += ["--retrieve_context", os.fspath(spec.retrieve_context)]
    argv += ["--input_list", os.fspath(spec.input_list), "--output_dir", os.fspath(spec.output_dir)]
    if spec.debug:
        argv.append("--debug")
    if spec.profiling_level:
        argv += ["--profiling_level", spec.profiling_level]
    if spec.profiling_option:
        argv += ["--profiling_option", spec.profiling_option]
    if spec.native_output:
        argv.append("--use_native_output_files")
    if spec.output_data_type:
        argv += ["--output_data_type", spec.output_data_type]
    if spec.native_input:
        argv.append("--use_native_input_files")
    if spec.native_input_tensor_names:
        argv += ["--native_input_tensor_names", ",".join(spec.native_input_tensor_names)]
    if spec.config_file is not None:
        argv += ["--config_file", os.fspath(spec.config_file)]
    if spec.log_level:
        argv += ["--log_level", spec.log_level]
    if spec.num_inferences is not None:
        argv += ["--num_inferences", str(spec.num_inferences)]
    if spec.perf_profile:
        argv += ["--perf_profile", spec.perf_profile]
    if spec.set_output_tensors:
        argv += ["--set_output_tensors", ",".join(spec.set_output_tensors)]
    argv += [os.fspath(a) for a in spec.extra_args]
    return argv


@dataclass
class NetRunResult:
    """A finished qnn-net-run."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    output_dir: Path

    @property
    def ok(self) -> bool:
        """True when qnn-net-run exited 0."""
        return self.returncode == 0


def run_local(spec: NetRunSpec, sdk: QnnSdk | None = None, timeout: float | None = None) -> NetRunResult:
    """Run qnn-net-run on this host (x86 backends; the HTP backend runs as Qualcomm's emulator).

    Raises:
        ToolNotFoundError: no SDK.
    """
    sdk = sdk or find_sdk()
    argv = build_command(spec, sdk.net_run, sdk)
    env = dict(os.environ)
    lib = sdk.lib_dir()
    if lib is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(x for x in (str(lib), env.get("LD_LIBRARY_PATH", "")) if x)
    Path(spec.output_dir).mkdir(parents=True, exist_ok=True)
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    return NetRunResult(argv, p.returncode, p.stdout, p.stderr, Path(spec.output_dir))


@dataclass
class DevicePlan:
    """The adb steps of a device run (each an argv), built by :func:`plan_device_run`."""

    steps: list[list[str]]
    device_dir: str
    local_output: Path
    shell_command: str


def plan_device_run(
    spec: NetRunSpec,
    inputs: InputList,
    sdk: QnnSdk,
    adb: str | os.PathLike = "adb",
    serial: str | None = None,
    device_dir: str = "/data/local/tmp/ivq_debug",
    dsp_arch: str = "v73",
    platform: str = DEVICE_PLATFORM,
) -> DevicePlan:
    """Plan a device run: push qnn-net-run, backend libraries, model and inputs; run; pull the output.

    The input list is rewritten with device paths (``<device_dir>/inputs/<i>/<name>.raw``).
    """
    spec.validate()
    a = [os.fspath(adb)] + (["-s", serial] if serial else [])
    bin_dir, lib_dir = sdk.bin_dir(platform), sdk.lib_dir(platform)
    if bin_dir is None or lib_dir is None:
        raise ToolNotFoundError("the SDK root is unknown: set QNN_SDK_ROOT to push the device binaries")
    arch = dsp_arch.lower().lstrip("v")
    pushes: list[Path] = [bin_dir / "qnn-net-run", lib_dir / BACKENDS.get(spec.backend, spec.backend)]
    if spec.backend == "htp":
        pushes += [lib_dir / f"libQnnHtpV{arch}Stub.so", lib_dir / "libQnnHtpPrepare.so",
                   sdk.root / "lib" / f"hexagon-v{arch}" / "unsigned" / f"libQnnHtpV{arch}Skel.so"]  # type: ignore[operator]
    for extra in (spec.model, spec.retrieve_context, spec.dlc_path, spec.config_file):
        if extra is not None:
            pushes.append(Path(extra))
    steps: list[list[str]] = [[*a, "shell", "mkdir", "-p", f"{device_dir}/inputs"]]
    steps += [[*a, "push", str(p), f"{device_dir}/"] for p in pushes]
    steps.append([*a, "push", str(inputs.path.parent / "inputs"), f"{device_dir}/"])
    dev_list = inputs.path.parent / f".{inputs.path.name}.device"
    lines = []
    for i, row in enumerate(inputs.files):
        lines.append(" ".join(f"{n}:={device_dir}/inputs/{i}/{row[n].name}" for n in inputs.names))
    dev_list.write_text("\n".join(lines) + "\n")
    steps.append([*a, "push", str(dev_list), f"{device_dir}/input_list.txt"])
    dev = NetRunSpec(**{**spec.__dict__})
    dev.input_list = f"{device_dir}/input_list.txt"
    dev.output_dir = f"{device_dir}/output"
    for attr in ("model", "retrieve_context", "dlc_path", "config_file"):
        v = getattr(spec, attr)
        if v is not None:
            setattr(dev, attr, f"{device_dir}/{Path(v).name}")
    backend = f"{device_dir}/{BACKENDS.get(spec.backend, Path(spec.backend).name)}"
    argv = build_command(dev, f"{device_dir}/qnn-net-run")
    argv[argv.index("--backend") + 1] = backend
    shell = (f"cd {shlex.quote(device_dir)} && rm -rf output && export LD_LIBRARY_PATH={shlex.quote(device_dir)} "
             f"ADSP_LIBRARY_PATH={shlex.quote(device_dir)} && " + " ".join(shlex.quote(x) for x in argv))
    steps.append([*a, "shell", shell])
    local_out = Path(spec.output_dir)
    steps.append([*a, "pull", f"{device_dir}/output", str(local_out)])
    return DevicePlan(steps, device_dir, local_out, shell)


def run_on_device(
    spec: NetRunSpec,
    inputs: InputList,
    sdk: QnnSdk | None = None,
    adb: str | os.PathLike | None = None,
    serial: str | None = None,
    device_dir: str = "/data/local/tmp/ivq_debug",
    dsp_arch: str = "v73",
    timeout: float | None = None,
) -> NetRunResult:
    """Run qnn-net-run on an Android device over adb (push, shell, pull).

    Raises:
        ToolNotFoundError: no adb or no SDK.
        InputError: an adb step failed (its stderr, on one line).
    """
    adb_path = find_adb(adb)
    sdk = sdk or find_sdk()
    plan = plan_device_run(spec, inputs, sdk, adb_path, serial, device_dir, dsp_arch)
    Path(spec.output_dir).parent.mkdir(parents=True, exist_ok=True)
    out, err, rc = "", "", 0
    for step in plan.steps:
        p = subprocess.run(step, capture_output=True, text=True, timeout=timeout, check=False)
        out += p.stdout
        err += p.stderr
        rc = p.returncode
        if p.returncode != 0:
            msg = " ".join((p.stderr or p.stdout).split())[:300]
            if step[-1] == plan.shell_command:
                return NetRunResult(step, rc, out, err, plan.local_output)
            raise InputError(f"adb step failed ({' '.join(step[:4])} …): {msg}")
    return NetRunResult(plan.steps[-2], rc, out, err, plan.local_output)
