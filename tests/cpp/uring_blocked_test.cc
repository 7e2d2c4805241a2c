// Where a seccomp profile blocks io_uring (as container runtimes do by default), opening
// a store says so, and how to fix it, instead of blaming the directory's permissions.
#include <gtest/gtest.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <string>

#include "backing/errors.h"
#include "backing/uring_file.h"
#include "tests/cpp/temp_dir.h"

namespace statepager {
namespace {

// Makes io_uring_setup fail with `err` in this process from now on (a seccomp filter,
// as a container's profile installs). False when seccomp filters are not allowed here.
bool block_io_uring_setup(int err) {
  sock_filter program[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | static_cast<unsigned>(err)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(program) / sizeof(program[0])), program};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0) == 0;
}

// In a child (the filter cannot be removed): 0 when opening a store under the filter
// throws IoUringUnavailableError whose message contains `expected` and no word of
// permissions; 77 when no filter can be installed; another code otherwise.
int open_under_filter(const std::string& dir, int err, const std::string& expected) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (!block_io_uring_setup(err)) ::_exit(77);
    int code = 1;
    try {
      UringFile f(dir + "/data", UringFile::Options{4, true});
      code = 2;
    } catch (const IoUringUnavailableError& e) {
      const std::string what = e.what();
      const bool names_fix = what.find(expected) != std::string::npos &&
                             what.find("seccomp") != std::string::npos &&
                             what.find("io_uring_setup") != std::string::npos;
      code = names_fix && what.find("writable") == std::string::npos ? 0 : 3;
    } catch (...) {
      code = 4;
    }
    ::_exit(code);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(UringBlocked, SeccompEpermSaysIoUringIsBlocked) {
  TempDir dir;
  const int code = open_under_filter(dir.path(), EPERM, "io_uring is blocked");
  if (code == 77) GTEST_SKIP() << "seccomp filters cannot be installed here (prctl refused)";
  EXPECT_EQ(code, 0) << "1: opened anyway, 3: wrong message, 4: another exception";
}

TEST(UringBlocked, SeccompEnosysSaysIoUringIsNotAvailable) {
  TempDir dir;
  const int code = open_under_filter(dir.path(), ENOSYS, "io_uring is not available");
  if (code == 77) GTEST_SKIP() << "seccomp filters cannot be installed here (prctl refused)";
  EXPECT_EQ(code, 0) << "1: opened anyway, 3: wrong message, 4: another exception";
}

}  // namespace
}  // namespace statepager
