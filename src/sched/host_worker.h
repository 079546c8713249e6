// One thread that runs jobs in the order given, with a cap on jobs pending (queued or running):
// past the cap the caller waits for the oldest instead of queueing more, as the in-flight queues
// do for device work (each pending job holds memory: an offloaded group's gradients on the host).
// The runtime runs offloaded groups' optimizer steps in backward on it, so that backward's thread
// goes on issuing GPU work while the host's optimizer runs.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace fsdp {

class HostWorker {
 public:
  HostWorker() = default;
  HostWorker(const HostWorker&) = delete;
  HostWorker& operator=(const HostWorker&) = delete;
  // Runs what is queued, then ends the thread.
  ~HostWorker();

  // Queues `job` after waiting until fewer than `limit` (>= 1) jobs are pending. Returns whether
  // it waited. The thread starts at the first job.
  bool submit(std::function<void()> job, int limit);
  // Waits until every job queued so far ran; if one threw, rethrows the first such exception
  // (once: later calls do not).
  void wait_all();
  // Jobs queued or running.
  int pending();

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> queue_;
  bool running_ = false;  // a job taken off the queue is running
  bool stopping_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace fsdp
