// A server (or scheduler-only) process: one ROUTER socket that workers push
// to and, when this node hosts the scheduler, that all control traffic
// reaches too; a control connection to the scheduler (possibly itself);
// the summation engine; heartbeats.
#ifndef BPS_TF_CORE_SERVER_SERVER_NODE_H_
#define BPS_TF_CORE_SERVER_SERVER_NODE_H_

#include <string>

#include "common/common.h"

namespace bps {

// Runs until the job ends. Returns the exit code; *error says why if not 0.
int RunServerNode(const Config& cfg, std::string* error);

}  // namespace bps

#endif  // BPS_TF_CORE_SERVER_SERVER_NODE_H_
