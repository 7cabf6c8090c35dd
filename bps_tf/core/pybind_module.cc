// bps_tf._core: the core for Python without TensorFlow (servers, init,
// and numpy push_pull used by tests and benchmarks).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bps_api.h"
#include "common/common.h"
#include "dtypes.h"
#include "math/compressor.h"
#include "scheduler/launcher_link.h"
#include "scheduler/scheduler.h"
#include "server/reply_scheduler.h"
#include "transport/channel.h"
#include "transport/cipher_pool.h"
#include "transport/curve_check.h"
#include "transport/link_cipher.h"
#include "transport/local_links.h"
#include "transport/protocol.h"
#include "transport/transport.h"
#include "worker/burst.h"
#include "worker/worker_task.h"

namespace py = pybind11;

namespace {

// A server's reply scheduler without a server, for tests: replies go in
// with a priority and a tag; ready() hands out what may leave, and the
// messages stay "in libzmq" until release() frees the oldest ones.
class ReplyProbe {
 public:
  ReplyProbe(int workers, uint64_t credit)
      : schedule_(workers, credit, [this] { ++wakes_; }) {}
  void Add(int worker, int32_t priority, size_t bytes, uint64_t tag) {
    std::vector<bps::ServerReply> v;
    v.push_back(bps::ServerReply{worker, bps::MakeHeader(bps::MsgType::kPullReply,
                                                         bps::Role::kServer, 0),
                                 bps::Msg(bytes)});
    v.back().header.key = tag;
    v.back().priority = priority;
    schedule_.Add(std::move(v));
  }
  std::vector<std::pair<int, uint64_t>> Ready() {
    std::vector<std::pair<int, uint64_t>> tags;
    for (auto& r : schedule_.Ready()) {
      tags.emplace_back(r.worker, r.header.key);
      const uint64_t n = r.payload.size();
      held_.push_back(schedule_.Track(r.worker, std::move(r.payload), n));
    }
    return tags;
  }
  void Release(size_t count) {
    count = std::min(count, held_.size());
    held_.erase(held_.begin(), held_.begin() + static_cast<long>(count));
  }
  int wakes() const { return wakes_; }
  uint64_t queued() const { return schedule_.queued(); }

 private:
  int wakes_ = 0;
  bps::ReplyScheduler schedule_;
  std::vector<bps::Msg> held_;  // destroyed before schedule_
};

std::string CallWithError(int (*fn)(const char*, char*, size_t), const std::string& config,
                          int* code) {
  std::vector<char> err(4096, '\0');
  {
    py::gil_scoped_release release;
    *code = fn(config.c_str(), err.data(), err.size());
  }
  return std::string(err.data());
}

// One asynchronous numpy push_pull; keeps its arrays alive until done.
class Handle {
 public:
  Handle(py::array in, py::array out) : in_(std::move(in)), out_(std::move(out)) {}

  static void Done(void* ctx, int status, const char* error) {
    auto* self = static_cast<std::shared_ptr<Handle>*>(ctx);
    {
      std::lock_guard<std::mutex> lock((*self)->mu_);
      (*self)->finished_ = true;
      (*self)->ok_ = status == BPS_OK;
      if (status != BPS_OK && error) (*self)->error_ = error;
    }
    (*self)->cv_.notify_all();
    // This runs on the engine's thread, and the handle may hold the last
    // references to its numpy arrays (Python may have dropped its own as soon
    // as Wait returned): releasing them needs the GIL, or the interpreter's
    // heap is corrupted under load. While Python shuts down the GIL cannot be
    // taken: the handle is left to the process's exit instead.
    if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
    py::gil_scoped_acquire gil;
    delete self;
  }

  // Waits up to timeout seconds (<0: forever); returns the output array.
  py::array Wait(double timeout) {
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(mu_);
      auto ready = [this] { return finished_; };
      if (timeout < 0) {
        cv_.wait(lock, ready);
      } else if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout), ready)) {
        throw std::runtime_error("push_pull did not finish within the timeout");
      }
    }
    if (!ok_) throw std::runtime_error(error_);
    return out_;
  }

  bool Done() {
    std::lock_guard<std::mutex> lock(mu_);
    return finished_;
  }

 private:
  py::array in_, out_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool finished_ = false;
  bool ok_ = false;
  std::string error_;
};

int DTypeCode(const py::array& a, const std::string& override_name) {
  std::string name = override_name.empty() ? std::string(py::str(a.dtype())) : override_name;
  int code = bps::DTypeFromName(name);
  if (code < 0) {
    throw py::type_error("bps_tf cannot push_pull dtype " + name + " (" + bps::DTypeNameList() +
                         ")");
  }
  return code;
}

// The compressors, for tests and for Compression.*.compress()/decompress().
void AddCompressors(py::module_& m) {
  using Floats = py::array_t<float, py::array::c_style | py::array::forcecast>;
  auto spec_of = [](const std::string& text) {
    try {
      return bps::CompressorSpec::Parse(text);
    } catch (const bps::Error& e) {
      throw py::value_error(e.what());
    }
  };
  m.def("compressor_text", [spec_of](const std::string& text) { return spec_of(text).Text(); },
        "The canonical text of a compressor description (ValueError if invalid).");
  m.def("compressed_bytes", [spec_of](const std::string& text, size_t n) {
    return bps::CompressedBytes(spec_of(text), n);
  });
  m.def("stream_seed", &bps::StreamSeed);
  m.def("wakeup_lost_count", &bps::WakeupLostCount, py::arg("items"), py::arg("timeout_ms"),
        py::call_guard<py::gil_scoped_release>());
  m.def("channel_slow_waits", &bps::ChannelSlowWaits, py::arg("rounds"), py::arg("timeout_ms"),
        py::call_guard<py::gil_scoped_release>());
  // Internal, for tests: the scheduler's rule naming the last worker to join.
  m.def("last_to_join", &bps::LastToJoin, py::arg("order"));
  m.def("machine_netns_id", &bps::MachineNetnsId);
  m.def("abstract_endpoint_listed", &bps::AbstractEndpointListed, py::arg("endpoint"));
  m.def("server_endpoint", [](const std::string& welcome, int s, const std::string& machine) {
    bool local = false;
    std::string endpoint = bps::ServerEndpoint(bps::Config::Parse(welcome), s, machine, &local);
    return py::make_tuple(endpoint, local);
  });
  m.def("compress", [spec_of](const std::string& text, Floats x, uint64_t stream) {
    bps::CompressorSpec spec = spec_of(text);
    size_t n = static_cast<size_t>(x.size());
    py::array_t<uint8_t> out(static_cast<py::ssize_t>(bps::CompressedBytes(spec, n)));
    bps::Compress(spec, x.data(), n, stream, reinterpret_cast<char*>(out.mutable_data()));
    return out;
  }, py::arg("spec"), py::arg("x"), py::arg("stream") = 0);
  m.def("decompress", [spec_of](const std::string& text, py::array_t<uint8_t> in, size_t n) {
    bps::CompressorSpec spec = spec_of(text);
    py::array_t<float> out(static_cast<py::ssize_t>(n));
    try {
      bps::Decompress(spec, reinterpret_cast<const char*>(in.data()),
                      static_cast<size_t>(in.size()), n, out.mutable_data());
    } catch (const bps::Error& e) {
      throw py::value_error(e.what());
    }
    return out;
  }, py::arg("spec"), py::arg("payload"), py::arg("n"));
  // One node's error-feedback residual and momentum for one tensor.
  py::class_<bps::CompressorState>(m, "CompressorState")
      .def(py::init<>())
      .def("encode", [spec_of](bps::CompressorState& st, const std::string& text, Floats g,
                               size_t offset, size_t total, uint64_t stream, bool use_momentum) {
        bps::CompressorSpec spec = spec_of(text);
        size_t n = static_cast<size_t>(g.size());
        py::array_t<uint8_t> out(static_cast<py::ssize_t>(bps::CompressedBytes(spec, n)));
        st.Encode(spec, g.data(), n, offset, total, stream, use_momentum,
                  reinterpret_cast<char*>(out.mutable_data()));
        return out;
      }, py::arg("spec"), py::arg("g"), py::arg("offset") = 0, py::arg("total") = 0,
         py::arg("stream") = 0, py::arg("use_momentum") = true);
}

// The engine: init, the worker's and the server's entry points, join, counters.
void AddEngine(py::module_& m) {
  m.def("worker_init", [](const std::string& config) {
    int code = 0;
    std::string err = CallWithError(&bps_worker_init, config, &code);
    if (code != 0) throw std::runtime_error(err);
  });
  m.def("worker_shutdown", [](const std::string& reason) {
    py::gil_scoped_release release;
    bps_worker_leave(reason.c_str());
  }, py::arg("reason") = "");
  m.def("is_initialized", [] { return bps_is_initialized() != 0; });
  m.def("rank", &bps_rank);
  m.def("size", &bps_size);
  m.def("local_rank", &bps_local_rank);
  m.def("local_size", &bps_local_size);
  m.def("cross_rank", &bps_cross_rank);
  m.def("cross_size", &bps_cross_size);
  m.def("is_homogeneous", [] { return bps_is_homogeneous() != 0; });
  m.def("start_timeline", [](const std::string& path) { return bps_start_timeline(path.c_str()); });
  m.def("stop_timeline", []() -> py::object {
    char path[4096];
    int code = bps_stop_timeline(path, sizeof(path));
    if (code == -1) return py::none();
    if (code == -2) throw std::runtime_error(std::string("cannot write the timeline to ") + path);
    return py::str(path);
  });
  m.def("server_run", [](const std::string& config) {
    int code = 0;
    std::string err = CallWithError(&bps_server_run, config, &code);
    return py::make_tuple(code, err);
  });
  m.def("set_tensor_label", [](const std::string& name, const std::string& label) {
    bps_set_tensor_label(name.c_str(), label.c_str());
  });
  m.def("set_activity", [](const std::string& text) { bps_set_activity(text.c_str()); });
  m.def("join", [] {
    char err[1024] = {0};
    int last;
    {
      py::gil_scoped_release release;
      last = bps_join(err, sizeof(err));
    }
    if (last < 0) throw std::runtime_error(err);
    return last;
  });
  m.def("refuse_when_joined", [](const std::string& name) {
    bps_refuse_when_joined(name.c_str());
  });
  m.def("debug_pause_sends", [](bool paused) { bps_debug_pause_sends(paused ? 1 : 0); });
  m.def("stats_json", [] {
    size_t need = bps_stats_json(nullptr, 0);
    std::string buf(need, '\0');
    bps_stats_json(&buf[0], buf.size());
    return std::string(buf.c_str());
  });
  m.def("elastic_request_leave", [] { return bps_elastic_request_leave() != 0; });
  // bpslaunch's link to an elastic job's scheduler (scheduler/launcher_link.h).
  py::class_<bps::LauncherLink>(m, "LauncherLink")
      .def(py::init([](const std::string& config) {
        try {
          return std::unique_ptr<bps::LauncherLink>(
              new bps::LauncherLink(bps::Config::Parse(config)));
        } catch (const bps::Error& e) {
          throw std::runtime_error(e.what());
        }
      }))
      .def("send", &bps::LauncherLink::Send, py::call_guard<py::gil_scoped_release>())
      .def("receive", &bps::LauncherLink::Receive, py::arg("timeout_ms") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("refusal", &bps::LauncherLink::Refusal)
      .def("close", &bps::LauncherLink::Close);
}

// One end of a sealed link (link_cipher.h) as bytes in and out, for tests:
// two of them make a link without sockets, and one with a pyzmq socket is a
// peer of the job whose messages can be changed, repeated or reordered.
class LinkEnd {
 public:
  explicit LinkEnd(const std::string& key) : key_(key), handshake_(key) {}
  py::bytes Hello() { return py::bytes(handshake_.Hello().str()); }
  py::bytes Answer(const std::string& hello) {
    bps::Msg in(hello.data(), hello.size()), answer;
    std::string why;
    if (!bps::LinkHandshake::Answer(key_, in, &answer, &cipher_, &why)) throw py::value_error(why);
    return py::bytes(answer.str());
  }
  void Finish(const std::string& answer) {
    std::string why;
    if (!handshake_.Finish(bps::Msg(answer.data(), answer.size()), &cipher_, &why)) {
      throw py::value_error(why);
    }
  }
  std::string suite() const { return cipher_.ready() ? bps::SuiteName(cipher_.suite()) : ""; }
  // (sealed header, ciphertext) of a 64-byte header and its payload.
  py::tuple Seal(const std::string& header, const std::string& payload) {
    bps::FrameHeader h;
    if (header.size() != sizeof(h)) throw py::value_error("a header is 64 bytes");
    std::memcpy(&h, header.data(), sizeof(h));
    std::vector<bps::Msg> frames;
    Ready()->Seal(h, bps::Msg(payload.data(), payload.size()), &frames);
    return py::make_tuple(py::bytes(frames[0].str()), py::bytes(frames[1].str()));
  }
  // One payload encrypted once and sealed for each of `ends` (link_cipher.h
  // SharedSeal): [(sealed header, ciphertext)] in their order.
  static py::list SealShared(const py::list& ends, const std::string& header,
                             const std::string& payload) {
    bps::FrameHeader h;
    if (header.size() != sizeof(h)) throw py::value_error("a header is 64 bytes");
    std::memcpy(&h, header.data(), sizeof(h));
    bps::Msg plain(payload.data(), payload.size());
    std::shared_ptr<bps::SharedSeal> seal;
    py::list out;
    for (py::handle e : ends) {
      bps::LinkCipher* c = e.cast<LinkEnd*>()->Ready();
      if (!seal) seal = std::make_shared<bps::SharedSeal>(c->suite(), plain);
      std::vector<bps::Msg> frames;
      c->SealShared(h, seal, bps::Msg(), &frames);
      out.append(py::make_tuple(py::bytes(frames[0].str()), py::bytes(frames[1].str())));
    }
    return out;
  }
  // ("ok" | "forged" | "replayed", header, payload) of a received message.
  py::tuple Open(const std::string& sealed, const std::string& payload) {
    bps::Msg s(sealed.data(), sealed.size()), p(payload.data(), payload.size());
    bps::FrameHeader h;
    std::memset(&h, 0, sizeof(h));
    auto v = Ready()->Open(s, &p, &h);
    const bool ok = v == bps::LinkCipher::Verdict::kOk;
    return py::make_tuple(ok ? "ok" : v == bps::LinkCipher::Verdict::kReplayed ? "replayed" : "forged",
                          py::bytes(reinterpret_cast<const char*>(&h), sizeof(h)),
                          py::bytes(ok ? p.str() : ""));
  }

 private:
  bps::LinkCipher* Ready() {
    if (!cipher_.ready()) throw py::value_error("the handshake is not done");
    return &cipher_;
  }
  std::string key_;
  bps::LinkHandshake handshake_;
  bps::LinkCipher cipher_;
};

// Internal, for tests: the engine's scheduling rules, one at a time.
void AddSchedulingProbes(py::module_& m) {
  py::class_<ReplyProbe>(m, "ReplyProbe")
      .def(py::init<int, uint64_t>(), py::arg("workers"), py::arg("credit"))
      .def("add", &ReplyProbe::Add, py::arg("worker"), py::arg("priority"), py::arg("bytes"),
           py::arg("tag"))
      .def("ready", &ReplyProbe::Ready)
      .def("release", &ReplyProbe::Release, py::arg("count"))
      .def_property_readonly("wakes", &ReplyProbe::wakes)
      .def_property_readonly("queued", &ReplyProbe::queued);
  // The order a worker sends one tensor's partitions in (WorkerEngine::Order).
  m.def("partition_send_order", [](uint32_t parts, uint32_t group, uint32_t stagger) {
    std::vector<uint32_t> order(parts);
    for (uint32_t p = 0; p < parts; ++p) order[p] = p;
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      return bps::PartitionSendOrder(a, parts, group, stagger) <
             bps::PartitionSendOrder(b, parts, group, stagger);
    });
    return order;
  });
  // How long a burst limits the credit after each of `enqueues` (times in
  // seconds): EnqueueBurst, as the worker engine keeps it.
  m.def("burst_limit_left", [](double limit_s, double gap_s, const std::vector<double>& enqueues,
                               const std::vector<double>& queries) {
    bps::EnqueueBurst burst(limit_s, gap_s);
    std::vector<double> left;
    size_t next = 0;
    for (double q : queries) {
      while (next < enqueues.size() && enqueues[next] <= q) burst.Enqueued(enqueues[next++]);
      left.push_back(burst.LimitLeft(q));
    }
    return left;
  });
  py::class_<LinkEnd>(m, "LinkEnd")
      .def(py::init<const std::string&>(), py::arg("key"))
      .def("hello", &LinkEnd::Hello)
      .def("answer", &LinkEnd::Answer, py::arg("hello"))
      .def("finish", &LinkEnd::Finish, py::arg("answer"))
      .def_property_readonly("suite", &LinkEnd::suite)
      .def("seal", &LinkEnd::Seal, py::arg("header"), py::arg("payload"))
      .def("open", &LinkEnd::Open, py::arg("sealed"), py::arg("payload"))
      .def_static("seal_shared", &LinkEnd::SealShared, py::arg("ends"), py::arg("header"),
                  py::arg("payload"));
  m.def("sodium_describe", &bps::SodiumDescribe);
  // BYTEPS_CIPHER_THREADS for this process (0: automatic); returns the
  // count in effect.
  m.def("set_cipher_threads", [](int n) {
    bps::SetCipherThreads(n);
    return bps::CipherThreads();
  }, py::arg("n"));
  // What runs libzmq's CURVE (curve_check.h); measure: time it when the
  // libzmq links no libsodium.
  m.def("curve_backend", [](bool measure) {
    bps::CurveBackend b = bps::CheckCurveBackend(measure);
    py::dict d;
    d["libzmq"] = b.libzmq;
    d["links_libsodium"] = b.links_libsodium;
    d["measured"] = b.measured;
    d["curve_mb_s"] = b.curve_mb_s;
    d["clear_mb_s"] = b.clear_mb_s;
    d["slow"] = b.slow();
    return d;
  }, py::arg("measure") = true);
  m.def("push_priority_roundtrip", [](int64_t priority, uint64_t flags) {
    uint64_t id = bps::PushPriorityBits(priority) | flags;
    return py::make_tuple(bps::PushPriorityOf(id), id & 0xffffffffu);
  });
}

// numpy push_pull, for tests, benchmarks and servers' own checks.
void AddPushPull(py::module_& m) {
  py::class_<Handle, std::shared_ptr<Handle>>(m, "Handle")
      .def("wait", &Handle::Wait, py::arg("timeout") = -1.0)
      .def("done", static_cast<bool (Handle::*)()>(&Handle::Done));

  // Starts a sum of `array` across workers; `out` receives it. Both must be
  // C-contiguous. dtype_name overrides numpy's name (e.g. "bfloat16" for
  // ml_dtypes arrays).
  m.def(
      "push_pull_async",
      [](const std::string& name, py::array in, py::array out, int64_t priority,
         const std::string& dtype_name, const std::string& compression,
         const std::string& agreement, int reduce_op) {
        if (!(in.flags() & py::array::c_style) || !(out.flags() & py::array::c_style)) {
          throw py::value_error("push_pull_async needs C-contiguous arrays");
        }
        if (in.nbytes() != out.nbytes()) throw py::value_error("in and out differ in size");
        if (reduce_op != 0 && !compression.empty()) {
          throw py::value_error("push_pull_async: a reduce_op other than sum takes no compression");
        }
        int dtype = DTypeCode(in, dtype_name);
        std::vector<int64_t> shape(in.shape(), in.shape() + in.ndim());
        auto handle = std::make_shared<Handle>(in, out);
        auto* ctx = new std::shared_ptr<Handle>(handle);
        const void* src = in.data();
        void* dst = out.mutable_data();
        {
          py::gil_scoped_release release;
          if (reduce_op != 0) {
            bps_enqueue_reduce(name.c_str(), dtype, shape.data(), static_cast<int>(shape.size()),
                               src, dst, priority, reduce_op, agreement.c_str(), &Handle::Done,
                               ctx);
          } else {
            bps_enqueue_push_pull_ex(name.c_str(), dtype, shape.data(),
                                     static_cast<int>(shape.size()), src, dst, priority,
                                     compression.c_str(), agreement.c_str(), &Handle::Done, ctx);
          }
        }
        return handle;
      },
      py::arg("name"), py::arg("array"), py::arg("out"), py::arg("priority") = 0,
      py::arg("dtype_name") = "", py::arg("compression") = "", py::arg("agreement") = "",
      py::arg("reduce_op") = 0);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "bps_tf core engine (no TensorFlow)";
  AddCompressors(m);
  AddEngine(m);
  AddSchedulingProbes(m);
  AddPushPull(m);
}
