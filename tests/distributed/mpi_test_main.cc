// main() of kvflow_mpi_tests, run by mpirun with 2 or more ranks: initialises MPI, runs every test
// on every rank (the tests are collective: each rank runs them in the same order), and exits
// non-zero on every rank when any rank failed. Rank 0 prints gtest's usual output; the other ranks
// print only their failures, prefixed by their rank (KVFLOW_MPI_TEST_VERBOSE=1: everything).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>

namespace {

class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (!result.failed()) return;
    const testing::TestInfo* test = testing::UnitTest::GetInstance()->current_test_info();
    std::fprintf(stderr, "[rank %d] %s.%s failed at %s:%d\n%s\n", rank_, test ? test->test_suite_name() : "?",
                 test ? test->name() : "?", result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  testing::InitGoogleTest(&argc, argv);
  const char* verbose = std::getenv("KVFLOW_MPI_TEST_VERBOSE");
  if (rank != 0 && (verbose == nullptr || std::string(verbose) != "1")) {
    testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  const int failed_here = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int failed_anywhere = 0;
  MPI_Allreduce(&failed_here, &failed_anywhere, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && failed_anywhere && !failed_here) std::fprintf(stderr, "kvflow_mpi_tests: another rank failed\n");
  MPI_Finalize();
  return failed_anywhere;
}
