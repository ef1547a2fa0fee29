/* qtorch-onnx: CPU copies of formats/ functions, one pass over memory instead of a chain of torch operations.
 * Built on first use by qtorch_onnx/cpu_kernels.py (cc -O3 -march=native -fno-math-errno -fno-trapping-math,
 * qtorch_onnx/native.py), loaded with ctypes; no torch headers. Like the Triton kernels, each function is an
 * accelerated copy of a formats/ function and is tested against it bit for bit (tests/test_cpu_kernels.py).
 *
 * qt_fake_quantize_tensor: formats/integer.py's fake_quantize for one (per-tensor) scale and zero point and a
 * type of at most 16 bits (docs/numerics.md section 1), the same float32 operations in the same order as its
 * fused path (_fake_quantize_fused):
 *   v = x / scale (IEEE division);  v = rint(v) (round half to even: the default rounding mode);  v = v + zp;
 *   c = clamp(v, qmin, qmax), NaN -> qmin;  y = (c - zp) * scale
 * No multiply is followed by an add the compiler could contract into one rounding (keep it so when editing). */
#include <math.h>
#include <stdint.h>

void qt_fake_quantize_tensor(int64_t i0, int64_t i1, const float *x, float *y, float scale, float zp, float qmin,
                             float qmax) {
    for (int64_t i = i0; i < i1; i++) {
        float v = rintf(x[i] / scale) + zp;
        float c = v < qmin ? qmin : (v > qmax ? qmax : v);
        c = c != c ? qmin : c; /* NaN: v compares false both ways and stays NaN above */
        y[i] = (c - zp) * scale;
    }
}

int qt_cpu_kernels_version(void) { return 1; }
