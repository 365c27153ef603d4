# Sourced by the scripts/gpu_*.sh device runs: the repository root as working directory, the
# GPU's Triton (tests/conftest.py defaults TRITON_INTERPRET to 1 for CPU runs), $OUT_DIR for the
# results ($OUT on the device machine), raypaged installed in place, and `quiet` to drop the
# progress bars and Ray's chatter from a log.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p "$OUT_DIR"
# (the log stays out of $OUT_DIR: a device call brings back at most eight files)
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/raypaged_pip.log 2>&1 \
    || { cat /tmp/raypaged_pip.log; exit 1; }

quiet() { grep --line-buffered -v "Loading weights\|it/s\]\|compiled_dag_node\|authentication_token"; }

# Ray from the .device/ bundle (the GPU machine has none; see ../shared/device/GPU.md), and the
# frontend's gRPC health / reflection services, which it lacks too: their 1.84.0 wheels in
# .device/ (pip download --no-deps -d .device "grpcio-health-checking==1.84.0"
# "grpcio-reflection==1.84.0"; 1.84.2 refuses the machine's grpcio 1.84.0).
use_ray() {
    source .device/setup.sh
    if ! python3 -c "import grpc_health, grpc_reflection" 2>/dev/null \
            && ls .device/grpcio_health_checking-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
            .device/grpcio_health_checking-*.whl .device/grpcio_reflection-*.whl
    fi
}
