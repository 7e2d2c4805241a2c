// Helpers for tests that run a body in a child process (it may set resource limits, such
// as RLIMIT_FSIZE, that must not touch the test runner).
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <functional>
#include <stdexcept>

namespace statepager {

// Runs `body` in a forked child; true when it returned (exit status 0), false when it
// threw (its message goes to stderr) or died.
inline bool in_child(const std::function<void()>& body) {
  const pid_t pid = fork();
  if (pid == 0) {
    int code = 0;
    try {
      body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
      code = 1;
    }
    _exit(code);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// For use inside in_child's body: throws `what` unless ok.
inline void check(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(what);
}

}  // namespace statepager
