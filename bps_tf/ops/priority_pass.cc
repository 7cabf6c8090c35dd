// Push_pull priorities from the graph TensorFlow runs.
//
// A GraphOptimizationPass compiled into the op library: it runs, with no
// configuration, on every graph TensorFlow prepares for execution (each
// tf.function instantiation, Keras train/eval/predict functions, TF1
// sessions). In a graph holding BytepsPushPull nodes it sets each gradient's
// `priority` attr from the topological position of its variable's first
// read: after a step, the next forward pass reads the first layer's
// variables first, so their gradients are needed first. Variables are
// ranked by (first read, smallest tensor_name of their push_pulls) and get
// 0, -1, -2, ... (higher leaves first); never-read variables go last.
//
// What counts as a gradient push_pull (the others keep their priority):
//  * its output flows, through value-forwarding and elementwise ops, into a
//    variable update (AssignSubVariableOp, ResourceApply*, ResourceScatter*,
//    ...). An update of an optimizer slot (Adam's m) is followed on through
//    the slot's later reads to the update of the variable itself; of all
//    variables reached, the one read first is the gradient's variable.
//  * its output does not flow into another push_pull's input: a reduction
//    of the forward pass (synchronized BatchNorm statistics) blocks the
//    whole step and keeps the priority its creator gave it.
// A push_pull that feeds another one only through integer tensors (the row
// counts of a sparse gradient's allgather, which size the rows' buffer)
// takes the priority of the push_pull it feeds. A push_pull whose node has
// `_bps_keep_priority` = true (a user's priority_fn chose it) is left alone.
// Under cross-step overlap a BytepsPushPullStart carries the gradient and
// the BytepsPushPullWait of the same tensor_name (applied in the same
// traced step, for the previous step) leads to the variable: the start is
// ranked by that variable's first read, like a push_pull.
//
// The pass only changes `priority` attrs (never a result), computes them
// from scratch each time (idempotent), and returns at once on graphs without
// push_pull. BYTEPS_PRIORITY_SCHEDULING=0 turns it off (FIFO).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <queue>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "bps_api.h"
#include "graph_rewrite.h"
#include "graph_util.h"
#include "priority_pass_stats.h"
#include "tensorflow/core/common_runtime/optimization_registry.h"
#include "tensorflow/core/graph/graph.h"

namespace bps_tf {
namespace {

using tensorflow::DataType;
using tensorflow::Edge;
using tensorflow::Graph;
using tensorflow::Node;

constexpr char kPushPull[] = "BytepsPushPull";
// Cross-step overlap: a gradient's push_pull starts in one step and its sum
// is waited for, and applied, in the next (bps_tf.overlap).
constexpr char kPushPullStart[] = "BytepsPushPullStart";
constexpr char kPushPullWait[] = "BytepsPushPullWait";
constexpr int64_t kUnread = std::numeric_limits<int64_t>::max();

// Ops that write a variable given as an input (resource or ref).
bool IsUpdate(const std::string& t) {
  return t == "AssignVariableOp" || t == "AssignAddVariableOp" || t == "AssignSubVariableOp" ||
         t == "Assign" || t == "AssignAdd" || t == "AssignSub" ||
         StartsWith(t, "ResourceApply") || StartsWith(t, "ResourceSparseApply") ||
         StartsWith(t, "ResourceScatter") || StartsWith(t, "Apply") ||
         StartsWith(t, "SparseApply") || StartsWith(t, "Scatter");
}

// Ops that read a variable's value from its handle.
bool IsRead(const std::string& t) {
  return t == "ReadVariableOp" || t == "ResourceGather" || t == "ResourceGatherNd";
}

// Ops a gradient passes through on its way to the update: forwarding and
// elementwise math, the sparse paths' gathers and segment sums, lowered
// control flow. No reductions and no AddN: a global norm would otherwise tie
// every gradient to every variable.
bool PassesThrough(const std::string& t) {
  static const std::unordered_set<std::string>* ops = new std::unordered_set<std::string>{
      "Identity", "IdentityN", "Snapshot", "Cast", "Neg", "Mul", "MulNoNan", "RealDiv", "Div",
      "DivNoNan", "FloorDiv", "TruncateDiv", "Sub", "AddV2", "Add", "Sqrt", "Rsqrt", "Square",
      "Maximum", "Minimum", "Reshape", "Sign", "Pow", "Select", "SelectV2", "ClipByValue",
      "ReadVariableOp", "ResourceGather", "GatherV2", "Unique", "UnsortedSegmentSum",
      "Switch", "Merge", "Enter", "Exit", "RefIdentity", "StopGradient", "ExpandDims",
      "Squeeze"};
  return ops->count(t) != 0;
}

bool IsHandle(DataType d) {
  return d == tensorflow::DT_RESOURCE || tensorflow::IsRefType(d);
}

// The node standing for a variable behind a handle: looks back through the
// ops that forward handles (inlined function arguments, loop entries).
const Node* HandleRoot(const Node* n, int output) {
  for (int hops = 0; hops < 64; ++hops) {
    const std::string& t = n->type_string();
    int from;
    if (t == "Identity" || t == "RefIdentity" || t == "Enter" || t == "RefEnter" ||
        t == "Switch" || t == "RefSwitch" || t == "Merge" || t == "RefMerge") {
      from = 0;
    } else if (t == "IdentityN") {
      from = output;
    } else {
      return n;
    }
    const Edge* e = DataInput(n, from);
    if (!e) return n;
    n = e->src();
    output = e->src_output();
  }
  return n;
}

// Node ids in a topological order: Kahn's algorithm, ready nodes taken by
// id (creation order, i.e. program order in a traced function); loop back
// edges (out of NextIteration) are ignored; nodes left on a cycle go last.
std::vector<int64_t> TopologicalPositions(const Graph& g) {
  const int n = g.num_node_ids();
  std::vector<int> pending(n, 0);
  std::vector<int64_t> pos(n, -1);
  for (const Node* node : g.nodes()) {
    for (const Edge* e : node->in_edges()) {
      if (!e->src()->IsNextIteration()) pending[node->id()]++;
    }
  }
  std::priority_queue<int, std::vector<int>, std::greater<int>> ready;
  for (const Node* node : g.nodes()) {
    if (pending[node->id()] == 0) ready.push(node->id());
  }
  int64_t next = 0;
  while (!ready.empty()) {
    int id = ready.top();
    ready.pop();
    pos[id] = next++;
    const Node* node = g.FindNodeId(id);
    if (node->IsNextIteration()) continue;
    for (const Edge* e : node->out_edges()) {
      if (--pending[e->dst()->id()] == 0) ready.push(e->dst()->id());
    }
  }
  for (const Node* node : g.nodes()) {
    if (pos[node->id()] < 0) pos[node->id()] = next++;
  }
  return pos;
}

struct Analysis {
  const Graph& g;
  std::vector<int64_t> pos;
  // variable root id -> its reads (ReadVariableOp, ResourceGather, ref Identity)
  std::unordered_map<int, std::vector<const Node*>> reads;
  std::unordered_map<int, int64_t> first_read;

  explicit Analysis(const Graph& graph) : g(graph), pos(TopologicalPositions(graph)) {}

  // Where a value is first used: reads float (they depend only on the
  // handle), so look through forwarding ops to the first real consumer.
  int64_t FirstUse(const Node* n, int depth) {
    int64_t best = kUnread;
    for (const Edge* e : n->out_edges()) {
      if (e->IsControlEdge()) continue;
      const Node* d = e->dst();
      const std::string& t = d->type_string();
      int64_t p = (depth < 16 && (t == "Identity" || t == "Snapshot" || t == "IdentityN"))
                      ? FirstUse(d, depth + 1)
                      : pos[d->id()];
      best = std::min(best, p);
    }
    return best;
  }

  void FindReads() {
    for (const Node* n : g.op_nodes()) {
      const std::string& t = n->type_string();
      bool read = IsRead(t);
      // A ref variable's value is read through an Identity of the variable.
      bool ref_read = t == "Identity" && n->num_inputs() == 1 &&
                      tensorflow::IsRefType(n->input_type(0)) &&
                      !tensorflow::IsRefType(n->output_type(0));
      if (!read && !ref_read) continue;
      const Edge* e = DataInput(n, 0);
      if (!e) continue;
      const Node* root = HandleRoot(e->src(), e->src_output());
      reads[root->id()].push_back(n);
      int64_t use = t == "ResourceGather" || t == "ResourceGatherNd" ? pos[n->id()]
                                                                      : FirstUse(n, 0);
      auto it = first_read.find(root->id());
      if (it == first_read.end() || use < it->second) first_read[root->id()] = use;
    }
  }

  int64_t FirstRead(int root) const {
    auto it = first_read.find(root);
    return it == first_read.end() ? kUnread : it->second;
  }

  // The variables whose updates `pp`'s value reaches (see the file comment).
  std::set<int> UpdatedVariables(const Node* pp) {
    std::set<int> roots;
    // (node, the only output followed, or -1 for all): an IdentityN carries
    // many gradients, and only the one that came in is followed out.
    std::unordered_set<int64_t> seen;
    std::vector<std::pair<const Node*, int>> todo;
    auto push = [&](const Node* n, int port) {
      if (seen.insert((static_cast<int64_t>(n->id()) << 24) + port + 1).second) {
        todo.push_back({n, port});
      }
    };
    push(pp, -1);
    while (!todo.empty() && seen.size() < 4096) {
      auto [n, port] = todo.back();
      todo.pop_back();
      for (const Edge* e : n->out_edges()) {
        if (e->IsControlEdge() || (port >= 0 && e->src_output() != port)) continue;
        const Node* d = e->dst();
        const std::string& t = d->type_string();
        if (IsUpdate(t)) {
          if (!seen.insert(static_cast<int64_t>(d->id()) << 24).second) continue;
          for (const Edge* in : d->in_edges()) {
            if (in->IsControlEdge() || !IsHandle(d->input_type(in->dst_input()))) continue;
            const Node* root = HandleRoot(in->src(), in->src_output());
            roots.insert(root->id());
            // A slot's later reads carry the update on (Adam's m -> var).
            auto r = reads.find(root->id());
            if (r == reads.end()) continue;
            for (const Node* read : r->second) {
              if (pos[read->id()] > pos[d->id()]) push(read, -1);
            }
          }
        } else if (t != kPushPull && PassesThrough(t)) {
          push(d, t == "IdentityN" ? e->dst_input() : -1);
        }
      }
    }
    return roots;
  }
};

// Ids of the nodes whose values reach some push_pull's input (loop back
// edges excluded), the push_pulls' own inputs included.
std::vector<bool> FeedsPushPull(const Graph& g, const std::vector<const Node*>& pps) {
  std::vector<bool> feeds(g.num_node_ids(), false);
  std::vector<const Node*> todo;
  for (const Node* pp : pps) todo.push_back(pp);
  std::vector<bool> seen(g.num_node_ids(), false);
  while (!todo.empty()) {
    const Node* n = todo.back();
    todo.pop_back();
    for (const Edge* e : n->in_edges()) {
      if (e->IsControlEdge() || e->src()->IsNextIteration()) continue;
      const Node* s = e->src();
      feeds[s->id()] = true;
      if (!seen[s->id()]) {
        seen[s->id()] = true;
        todo.push_back(s);
      }
    }
  }
  return feeds;
}

// The push_pulls `pp` feeds through integer tensors only (a few hops).
std::vector<const Node*> IntegerFed(const Node* pp) {
  std::vector<const Node*> out;
  std::unordered_set<int> seen{pp->id()};
  std::vector<std::pair<const Node*, int>> todo{{pp, 0}};
  while (!todo.empty()) {
    auto [n, depth] = todo.back();
    todo.pop_back();
    for (const Edge* e : n->out_edges()) {
      if (e->IsControlEdge()) continue;
      const Node* d = e->dst();
      if (d->type_string() == kPushPull) {
        if (n != pp) out.push_back(d);
        continue;
      }
      if (depth >= 12 || !IsIntegral(n->output_type(e->src_output()))) continue;
      if (seen.insert(d->id()).second) todo.push_back({d, depth + 1});
    }
  }
  return out;
}

bool Enabled() {
  static const bool on = [] {
    const char* v = std::getenv("BYTEPS_PRIORITY_SCHEDULING");
    if (!v || !*v) return true;
    std::string s(v);
    for (char& c : s) c = static_cast<char>(tolower(c));
    return !(s == "0" || s == "false" || s == "no" || s == "off");
  }();
  return on;
}

bool DebugLog() {
  static const bool env = [] {
    const char* v = std::getenv("BYTEPS_LOG_LEVEL");
    if (!v) return false;
    std::string s(v);
    for (char& c : s) c = static_cast<char>(toupper(c));
    return s == "DEBUG" || s == "TRACE";
  }();
  return env || bps_log_enabled(BPS_LOG_DEBUG);
}

int64_t GetPriority(const Node* n) {
  const tensorflow::AttrValue* v = n->attrs().Find("priority");
  return v ? v->i() : 0;
}

// Push_pulls built with an explicit priority choice (a priority_fn) carry
// the node attr `_bps_keep_priority`; the pass leaves them alone.
bool KeepsPriority(const Node* n) {
  const tensorflow::AttrValue* v = n->attrs().Find("_bps_keep_priority");
  return v && v->b();
}

std::string TensorName(const Node* n) {
  const tensorflow::AttrValue* v = n->attrs().Find("tensor_name");
  return v && !v->s().empty() ? v->s() : n->name();
}

// Logs a graph's decisions once per distinct list.
void LogDecisions(const std::vector<std::pair<std::string, int64_t>>& list, int64_t nodes) {
  std::string text;
  for (const auto& item : list) {
    text += (text.empty() ? "" : ", ") + item.first + "=" + std::to_string(item.second);
  }
  static std::mutex mu;
  static std::set<uint64_t>* logged = new std::set<uint64_t>();
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!logged->insert(bps_fnv1a64(text.data(), text.size())).second) return;
  }
  bps_log(BPS_LOG_DEBUG, ("priority pass: graph of " + std::to_string(nodes) +
                          " nodes, push_pull priorities: " + text).c_str());
}

class PriorityPass : public tensorflow::GraphOptimizationPass {
 public:
  absl::Status Run(const tensorflow::GraphOptimizationPassOptions& options) override {
    if (options.graph == nullptr || !*options.graph) return absl::OkStatus();
    auto start = std::chrono::steady_clock::now();
    Graph* g = options.graph->get();
    // TF1 sessions with the graph rewrite on: insert push_pulls first.
    absl::Status inserted = InsertPushPulls(g, options.is_function_graph);
    if (!inserted.ok()) return inserted;
    // The early exit is this scan: one string compare per node, which
    // rejects on the length for almost every op type.
    static const std::string* kType = new std::string(kPushPull);
    static const std::string* kStart = new std::string(kPushPullStart);
    static const std::string* kWait = new std::string(kPushPullWait);
    std::vector<Node*> pps;
    std::vector<const Node*> waits;
    for (Node* n : g->op_nodes()) {
      const std::string& t = n->type_string();
      if (t == *kType || t == *kStart) {
        pps.push_back(n);
      } else if (t == *kWait) {
        waits.push_back(n);
      }
    }
    bool has = !pps.empty();
    if (has && Enabled()) {
      Assign(*g, pps, waits);
    } else if (has) {
      Keep(pps);
    }
    int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                     std::chrono::steady_clock::now() - start).count();
    PassStats::Get().Record(has, g->num_op_nodes(), ns);
    return absl::OkStatus();
  }

 private:
  // Turned off: the kernels receive the priorities the graph was built with.
  static void Keep(const std::vector<Node*>& pps) {
    std::vector<std::pair<std::string, int64_t>> kept;
    for (const Node* pp : pps) kept.emplace_back(TensorName(pp), GetPriority(pp));
    PassStats::Get().RecordDecisions(kept);
  }

  // Of the variables `n`'s value updates, the one read first (-1: none).
  static int VariableOf(const Graph& g, Analysis& a, const Node* n) {
    std::set<int> roots = a.UpdatedVariables(n);
    if (roots.empty()) return -1;
    auto key = [&](int id) { return std::make_pair(a.FirstRead(id), g.FindNodeId(id)->name()); };
    int best = *roots.begin();
    for (int r : roots) {
      if (key(r) < key(best)) best = r;
    }
    return best;
  }

  static void Assign(const Graph& g, const std::vector<Node*>& pps,
                     const std::vector<const Node*>& waits) {
    Analysis a(g);
    a.FindReads();
    std::vector<const Node*> cpps;
    for (const Node* pp : pps) {
      if (pp->type_string() == kPushPull) cpps.push_back(pp);
    }
    std::vector<bool> feeds = FeedsPushPull(g, cpps);
    // A waited sum's key -> the variable it updates (overlap's starts).
    std::unordered_map<std::string, int> waited;
    for (const Node* w : waits) {
      int v = VariableOf(g, a, w);
      if (v >= 0) waited[TensorName(w)] = v;
    }
    // gradient push_pull (or overlap start) -> its variable (root id)
    std::unordered_map<const Node*, int> variable_of;
    for (const Node* pp : pps) {
      if (KeepsPriority(pp)) continue;  // chosen by the user (priority_fn)
      if (pp->type_string() != kPushPull) {
        auto it = waited.find(TensorName(pp));
        if (it != waited.end()) variable_of[pp] = it->second;
        continue;                       // a start without its wait: keep
      }
      if (feeds[pp->id()]) continue;   // forward-pass reduction: keep
      int v = VariableOf(g, a, pp);
      if (v >= 0) variable_of[pp] = v;  // else not traced to a variable: keep
    }
    // Rank the variables by (first read, name), the name being the smallest
    // tensor_name of the variable's push_pulls: the same on every worker.
    std::unordered_map<int, std::string> name_of;
    for (const auto& kv : variable_of) {
      std::string n = TensorName(kv.first);
      auto it = name_of.find(kv.second);
      if (it == name_of.end() || n < it->second) name_of[kv.second] = n;
    }
    std::vector<int> vars;
    for (const auto& kv : name_of) vars.push_back(kv.first);
    std::sort(vars.begin(), vars.end(), [&](int x, int y) {
      return std::make_pair(a.FirstRead(x), name_of[x]) <
             std::make_pair(a.FirstRead(y), name_of[y]);
    });
    std::unordered_map<int, int64_t> rank;
    for (size_t i = 0; i < vars.size(); ++i) rank[vars[i]] = -static_cast<int64_t>(i);
    std::unordered_map<const Node*, int64_t> priority;
    for (const auto& kv : variable_of) priority[kv.first] = rank[kv.second];
    // Integer feeders (sparse row counts) take the priority of what they feed.
    for (const Node* pp : pps) {
      if (priority.count(pp) || !feeds[pp->id()] || KeepsPriority(pp)) continue;
      int64_t best = std::numeric_limits<int64_t>::min();
      for (const Node* fed : IntegerFed(pp)) {
        auto it = priority.find(fed);
        if (it != priority.end()) best = std::max(best, it->second);
      }
      if (best != std::numeric_limits<int64_t>::min()) priority[pp] = best;
    }
    std::vector<std::pair<std::string, int64_t>> decided;
    for (Node* pp : pps) {
      auto it = priority.find(pp);
      int64_t p = it == priority.end() ? GetPriority(pp) : it->second;
      if (it != priority.end() && GetPriority(pp) != p) pp->AddAttr("priority", p);
      decided.emplace_back(TensorName(pp), p);
    }
    std::sort(decided.begin(), decided.end());
    PassStats::Get().RecordDecisions(decided);
    if (DebugLog()) LogDecisions(decided, g.num_op_nodes());
  }
};

}  // namespace

// After LowerFunctionalOpsPass (PRE_PLACEMENT, phase 10) has inlined
// function calls and lowered control flow, before placement and Grappler:
// the graph that is then placed and run, whole.
REGISTER_OPTIMIZATION(tensorflow::OptimizationPassRegistry::PRE_PLACEMENT, 60, PriorityPass);

}  // namespace bps_tf
