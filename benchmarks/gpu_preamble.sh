# Sourced by the device scripts (final_gpu.sh, scan_outputs_gpu.sh, token_weights_gpu.sh, gpu_check_n64.sh): the
# repository root as the working folder, the package importable, $OUT made (the device's, or ./gpu_out), status=0,
# want PART (true when $PARTS names it), and $OUT/gpu.txt with the GPU, its clocks and the commit measured.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
status=0
want() { [[ " $PARTS " == *" $1 "* ]]; }
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
  echo "commit ${MAMBA3_COMMIT:-unknown} $(date -u +%FT%TZ)"; } | tee "$OUT/gpu.txt"
