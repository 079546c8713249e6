#include "train/step_log.h"

#include <cmath>
#include <cstdio>
#include <sstream>
#include <stdexcept>

#include "io/files.h"

namespace fsdp::train {
namespace {

// JSON has no NaN or infinity: a non-finite number is written as null.
std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream out;
  out.precision(9);
  out << v;
  return out.str();
}

}  // namespace

RuntimeStats counted_between(const RuntimeStats& before, const RuntimeStats& after) {
  RuntimeStats d;
  d.allgather_waits = after.allgather_waits - before.allgather_waits;
  d.reduce_scatter_waits = after.reduce_scatter_waits - before.reduce_scatter_waits;
  d.host_step_waits = after.host_step_waits - before.host_step_waits;
  d.prefetches = after.prefetches - before.prefetches;
  d.order_departures = after.order_departures - before.order_departures;
  d.all_gathers = after.all_gathers - before.all_gathers;
  d.reduce_scatters = after.reduce_scatters - before.reduce_scatters;
  return d;
}

StepLog::StepLog(std::string path) : path_(std::move(path)) {
  const std::string dir = io::parent_of(path_);
  if (!io::is_directory(dir)) io::make_directories(dir);  // the default runs/<date-time>/
  out_.open(path_);
  out_.precision(9);  // enough to compare runs (resume, resharding) step by step
  check();
}

void StepLog::check() const {
  if (!out_) throw std::runtime_error("cannot write the log '" + path_ + "'");
}

void StepLog::write(const StepRecord& r) {
  const double tok_s = r.tokens_per_step / (r.ms / 1000.0);
  const MemoryPeaks& mem = r.memory;
  std::printf("step %4d/%d | loss %.4f | lr %.2e", r.step, r.steps, r.loss, r.lr);
  if (r.grad_norm) std::printf(" | grad norm %.3f", *r.grad_norm);
  std::printf(" | %8.0f tok/s | %7.1f ms | %s %.2f", tok_s, r.ms, r.on_gpu ? "peak alloc/reserved" : "peak rss",
              mem.allocated_gib);
  if (r.on_gpu) std::printf("/%.2f", mem.reserved_gib);
  std::printf(" GiB | waits ag %ld rs %ld", r.waits.allgather_waits, r.waits.reduce_scatter_waits);
  if (r.shows_host_steps) std::printf(" host steps %ld", r.waits.host_step_waits);
  std::printf("\n");
  if (r.eval)
    std::printf("eval after step %d | loss %.4f | perplexity %.2f | %lld tokens\n", r.step, r.eval->loss,
                r.eval->perplexity, (long long)r.eval->tokens);
  std::fflush(stdout);
  out_ << "{\"step\":" << r.step << ",\"loss\":" << json_number(r.loss) << ",\"lr\":" << r.lr
       << ",\"grad_norm\":" << (r.grad_norm ? json_number(*r.grad_norm) : "null")
       << ",\"skipped\":" << (r.skipped ? "true" : "false") << ",\"tok_s\":" << tok_s << ",\"step_ms\":" << r.ms
       << ",\"peak_alloc_gib\":" << mem.allocated_gib << ",\"peak_reserved_gib\":" << mem.reserved_gib
       << ",\"peak_active_gib\":" << mem.active_gib << ",\"alloc_retries\":" << mem.alloc_retries
       << ",\"allgather_waits\":" << r.waits.allgather_waits
       << ",\"reduce_scatter_waits\":" << r.waits.reduce_scatter_waits
       << ",\"host_step_waits\":" << r.waits.host_step_waits << ",\"prefetches\":" << r.waits.prefetches
       << ",\"tokens_per_step\":" << r.tokens_per_step << ",\"flops_per_token\":" << r.flops_per_token
       << ",\"alloc_end_bytes\":" << mem.allocated_now_bytes << ",\"reserved_end_bytes\":" << mem.reserved_now_bytes
       << ",\"rss_gib\":" << mem.rss_now_gib << ",\"world\":" << r.world << ",\"model\":\"" << r.model << "\"";
  if (r.eval) out_ << ",\"eval_loss\":" << r.eval->loss << ",\"eval_ppl\":" << r.eval->perplexity;
  out_ << "}\n";
  out_.flush();
  check();
}

void StepLog::close() {
  out_.close();
  check();
}

}  // namespace fsdp::train
