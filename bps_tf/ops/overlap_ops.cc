// Op registrations of the split push_pull used for cross-step overlap.
//
// BytepsPushPullStart hands a tensor to the engine and returns at once;
// BytepsPushPullWait, usually in the next training step, waits for that
// key's sum. Between the two the result lives in a per-process table
// keyed by tensor_name (kernels/overlap_kernels.cc). All of them are
// stateful; the Python loader lists Start and Wait as asynchronous stateful
// ops so tf.function neither chains them in program order nor waits for
// them at every stateful op.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace bps_tf {

// Output 0 shaped like input 0, output 1 a scalar (Wait's `valid`, the
// debug hold's log).
static tensorflow::Status LikeInputAndScalar(tensorflow::shape_inference::InferenceContext* c) {
  c->set_output(0, c->input(0));
  c->set_output(1, c->Scalar());
  return tensorflow::Status();
}

REGISTER_OP("BytepsPushPullStart")
    .Input("tensor: T")
    .Output("token: int64")
    .Attr("T: {half, bfloat16, float, double, int32, int64}")
    .Attr("tensor_name: string")
    .Attr("priority: int = 0")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
Starts the cross-worker sum of `tensor` and returns at once.

The sum is kept under `tensor_name` until BytepsPushPullWait takes it.
Starting a name that is still pending is an error. `token` is a sequence
number, only useful as a control dependency.
)doc");

REGISTER_OP("BytepsPushPullWait")
    .Input("like: T")
    .Output("sum: T")
    .Output("valid: bool")
    .Attr("T: {half, bfloat16, float, double, int32, int64}")
    .Attr("tensor_name: string")
    .SetIsStateful()
    .SetShapeFn(LikeInputAndScalar)
    .Doc(R"doc(
Waits for the sum started under `tensor_name` and takes it out of the table.

valid: false when nothing was pending under that name (then `sum` is zeros
shaped like `like`). An engine failure of the pending sum is this op's error.
)doc");

REGISTER_OP("BytepsPushPullPendingKeys")
    .Output("keys: string")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnknownShape)
    .Doc(R"doc(
The names started and not yet taken by a Wait, sorted.
)doc");

REGISTER_OP("BytepsPushPullDebugHold")
    .Input("x: T")
    .Output("y: T")
    .Output("log: string")
    .Attr("T: type")
    .Attr("command: {'hold', 'marker', 'log'}")
    .Attr("tensor_name: string = ''")
    .Attr("timeout_ms: int = 10000")
    .SetIsStateful()
    .SetShapeFn(LikeInputAndScalar)
    .Doc(R"doc(
Diagnostics for tests of cross-step overlap; y is x.

command 'hold': the next push_pull started under tensor_name is kept from
its wait once finished, until a 'marker' runs (or timeout_ms passes).
'marker': ends the hold, logging "<name> released-by marker" if the sum had
finished (and was held), "<name> in-flight-at marker" if it had not.
'log': only returns the log. A timeout logs "<name> released-by timeout".
)doc");

}  // namespace bps_tf
