#include "train/progress_line.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace fsdp::train {
namespace {

bool on_a_terminal() {
  const char* told = std::getenv("FSDP_STDOUT_IS_TERMINAL");  // fsdp-run's, for the ranks' pipes
  return isatty(STDOUT_FILENO) || (told && std::strcmp(told, "1") == 0);
}

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

// 12.30 GB, or 41.9 MB below a gigabyte; `per` "/s" for a rate.
std::string bytes_text(double bytes, const char* per = "") {
  char text[32];
  if (bytes >= 1e9)
    std::snprintf(text, sizeof(text), "%.2f GB%s", bytes / 1e9, per);
  else
    std::snprintf(text, sizeof(text), "%.1f MB%s", bytes / 1e6, per);
  return text;
}

}  // namespace

ProgressLine::ProgressLine(std::string what, bool lead)
    : what_(std::move(what)), shown_(lead && on_a_terminal()), start_(std::chrono::steady_clock::now()), last_(start_) {}

ProgressLine::~ProgressLine() { end(); }

void ProgressLine::end() {
  if (drawn_) {
    std::printf("\r\033[K");
    std::fflush(stdout);
  }
  drawn_ = shown_ = false;
}

void ProgressLine::update(int64_t done, int64_t total) {
  done_ = done;
  if (!shown_ || total <= 0) return;
  const auto now = std::chrono::steady_clock::now();
  if (seconds(now - last_) < 0.5) return;
  last_ = now;
  const double elapsed = seconds(now - start_), rate = done / std::max(elapsed, 1e-9);
  const int left = static_cast<int>(done > 0 ? (total - done) / rate : 0);
  std::printf("\r\033[Kfsdp-train: %s: %.0f%% of %s, %s, %d:%02d left", what_.c_str(), 100.0 * done / total,
              bytes_text(total).c_str(), bytes_text(rate, "/s").c_str(), left / 60, left % 60);
  std::fflush(stdout);
  drawn_ = true;
}

ByteProgress ProgressLine::callback() {
  return [this](int64_t done, int64_t total) { update(done, total); };
}

std::string ProgressLine::moved() const {
  const double elapsed = seconds(std::chrono::steady_clock::now() - start_);
  return bytes_text(done_) + " at " + bytes_text(done_ / std::max(elapsed, 1e-9), "/s");
}

}  // namespace fsdp::train
