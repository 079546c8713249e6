// gtest main for the multi-rank tests: every rank runs every test; rank 0
// prints the usual report, the others print only their failures. Built twice:
// fsdp_mpi_tests (CPU, MPI) and fsdp_gpu_tests (CUDA, NCCL; FSDP_TEST_NCCL).
#include <gtest/gtest.h>

#include <cstdio>

#include "fsdp/fsdp.h"

namespace {

class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  fsdp::InitOptions options;
#ifdef FSDP_TEST_NCCL
  options.backend = fsdp::Backend::Nccl;
#else
  options.backend = fsdp::Backend::Mpi;
#endif
  options.timeout = std::chrono::seconds(60);
  auto comm = fsdp::init(options);
  if (comm->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(comm->rank()));
  }
  const int result = RUN_ALL_TESTS();
  comm.reset();
  fsdp::shutdown();
  return result;
}
