/* RMS normalisation, the SwiGLU product and the rotary embedding on CPU, forward and backward, each one
 * pass over its rows (kernels/cpu_fused.py). Their PyTorch forms (megabam/model/layers.py,
 * positional.py) take 3 to 10 elementwise passes and copies (a concatenation of the two halves'
 * gradients, complex views), about 14 % of a training step of the tiny models at 2,048 tokens
 * (docs/log/benchmarks-history.md, "CPU training speed"). Built at first use by kernels/cpu_build.py.
 * Rows are contiguous. Results do not depend on the thread count: each row is computed whole by one
 * thread, and the weight gradient's sum over rows is taken over fixed blocks, then in block order.
 */
#include <math.h>
#include <stdint.h>

#define NORM_BLOCK 64 /* rows per partial sum of the weight gradient */

/* Each op is written once, as plain C over an element type T, in cpu_fused_impl.h, and compiled once per
 * type by including it with the type's definitions (that header lists them). */
#define T float
#define NAME(x) x##_f32
#define EXP expf
#define SQRT sqrtf
#define EXP_MAX 88.0f
#include "cpu_fused_impl.h"
#undef T
#undef NAME
#undef EXP
#undef SQRT
#undef EXP_MAX

#define T double
#define NAME(x) x##_f64
#define EXP exp
#define SQRT sqrt
#define EXP_MAX 709.0
#include "cpu_fused_impl.h"
#undef T
#undef NAME
#undef EXP
#undef SQRT
#undef EXP_MAX
