// Op registrations. The ops are stateful so Grappler never folds, merges or
// prunes them; the Python loader also lists them as asynchronous stateful ops
// so tf.function does not chain them in program order (they overlap).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace bps_tf {

REGISTER_OP("BytepsPushPull")
    .Input("tensor: T")
    .Output("sum: T")
    .Attr("T: {half, bfloat16, float, double, int32, int64}")
    .Attr("tensor_name: string")
    .Attr("priority: int = 0")
    .Attr("compression: string = ''")
    .Attr("agreement: string = ''")
    .Attr("reduce_op: {'sum', 'min', 'max', 'product'} = 'sum'")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape)
    .Doc(R"doc(
Sums `tensor` across all bps_tf workers through the parameter servers.

tensor_name: matches this tensor across workers; must be the same everywhere.
priority: partitions of higher-priority tensors are sent first.
compression: the core's compressor for float32 tensors ("" for none), e.g.
  "topk ratio=0.01 ef=1"; see docs/compression.md.
agreement: what every worker must pass alike under this name, e.g. the reduce
  op or "set=0,2" (a process set: only those ranks take part).
reduce_op: how the servers combine the workers' tensors; anything but 'sum'
  takes no compression and runs on the CPU kernel.
)doc");

REGISTER_OP("BytepsBroadcast")
    .Input("tensor: T")
    .Output("output: T")
    .Attr("T: {half, bfloat16, float, double, int32, int64}")
    .Attr("tensor_name: string")
    .Attr("root_rank: int")
    .Attr("priority: int = 0")
    .Attr("agreement: string = ''")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape)
    .Doc(R"doc(
Returns root_rank's value of `tensor` on every worker.

agreement: as BytepsPushPull's ("set=0,2": among those ranks; root_rank is a
  global rank).
)doc");

REGISTER_OP("BytepsMembership")
    .Output("value: int32")
    .Attr("query: {'rank', 'size', 'local_rank', 'local_size', 'cross_rank', 'cross_size'}")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc(R"doc(
This worker's place in the current membership, read when the op runs.

An elastic job's membership changes while traced graphs live on: a graph
that averages by `size` or picks rows by `rank` reads them here, so it stays
right after workers leave or join. Stateful, so it is never folded into a
constant.

query: which number: rank, size, local_rank, local_size, cross_rank or
  cross_size.
)doc");

}  // namespace bps_tf
