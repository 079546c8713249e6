#include "sched/host_worker.h"

#include <stdexcept>
#include <string>
#include <utility>

namespace fsdp {

HostWorker::~HostWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool HostWorker::submit(std::function<void()> job, int limit) {
  if (limit < 1) throw std::invalid_argument("fsdp: HostWorker::submit needs a limit of at least 1, got " +
                                             std::to_string(limit));
  std::unique_lock<std::mutex> lock(mutex_);
  const auto has_room = [&] { return static_cast<int>(queue_.size()) + (running_ ? 1 : 0) < limit; };
  const bool waited = !has_room();
  changed_.wait(lock, has_room);
  queue_.push_back(std::move(job));
  if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  lock.unlock();
  changed_.notify_all();
  return waited;
}

void HostWorker::wait_all() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return queue_.empty() && !running_; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

int HostWorker::pending() {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int>(queue_.size()) + (running_ ? 1 : 0);
}

void HostWorker::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    std::function<void()> job = std::move(queue_.front());
    queue_.pop_front();
    running_ = true;
    lock.unlock();
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    job = nullptr;  // what the job holds goes before it counts as done
    lock.lock();
    running_ = false;
    if (error && !error_) error_ = error;
    changed_.notify_all();
  }
}

}  // namespace fsdp
