#include "backing/store_dir.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "backing/errors.h"

namespace statepager {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string templ = "/tmp/statepager_store_XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp");
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path_, ec);
  }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void touch(const std::string& path, const std::string& text = "x") { std::ofstream(path) << text; }

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(StoreDir, CreatesParentsAndJoinsNames) {
  TempDir tmp;
  const std::string path = tmp.sub("a/b/store");
  StoreDir dir(path);
  EXPECT_TRUE(fs::is_directory(path));
  EXPECT_EQ(dir.path(), path);
  EXPECT_EQ(dir.file("pages"), path + "/pages");
}

TEST(StoreDir, WipesLeftoverEntriesAndRecordsPid) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  fs::create_directories(path + "/nested/deeper");
  touch(path + "/pages");
  touch(path + "/nested/deeper/file");
  touch(path + "/.hidden");
  touch(path + "/.lock", "stale");
  touch(tmp.sub("outside"));
  fs::create_symlink(tmp.sub("outside"), path + "/link");

  StoreDir dir(path);
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(path)) left.push_back(e.path().filename());
  EXPECT_EQ(left, std::vector<std::string>{".lock"});
  EXPECT_EQ(slurp(path + "/.lock"), std::to_string(::getpid()) + "\n");
  EXPECT_TRUE(fs::exists(tmp.sub("outside"))) << "a symlink's target was deleted";
}

TEST(StoreDir, SecondInSameProcessIsBusy) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  StoreDir first(path);
  touch(first.file("pages"));
  try {
    StoreDir second(path);
    FAIL() << "a second StoreDir on " << path << " was allowed";
  } catch (const StoreBusyError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    EXPECT_NE(what.find("process " + std::to_string(::getpid())), std::string::npos) << what;
  }
  EXPECT_TRUE(fs::exists(first.file("pages"))) << "the refused StoreDir wiped the live store";
}

TEST(StoreDir, ForkedChildSeesParentsLock) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  StoreDir dir(path);
  const std::string parent = "process " + std::to_string(::getpid());
  pid_t pid = ::fork();
  if (pid == 0) {
    int code = 1;  // no error
    try {
      StoreDir other(path);
    } catch (const StoreBusyError& e) {
      code = std::string(e.what()).find(parent) != std::string::npos ? 0 : 2;
    } catch (...) {
      code = 3;
    }
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: child took the lock, 2: pid not named, 3: other error";
}

TEST(StoreDir, HeldByAnotherProcessIsBusyUntilItExits) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  int ready[2], release[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(release), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(ready[0]);
    ::close(release[1]);  // so that the parent's exit, too, releases the child
    char c = 0;
    std::unique_ptr<StoreDir> dir;  // held until the child exits
    try {
      dir = std::make_unique<StoreDir>(path);
      touch(dir->file("pages"));
      c = 1;
    } catch (...) {
    }
    if (::write(ready[1], &c, 1) != 1) ::_exit(1);
    (void)!::read(release[0], &c, 1);
    ::_exit(0);  // the kernel closes the lock file, releasing the lock
  }
  ::close(ready[1]);
  ::close(release[0]);
  char c = 0;
  const bool child_ready = ::read(ready[0], &c, 1) == 1 && c == 1;
  if (child_ready) {
    try {
      StoreDir dir(path);
      ADD_FAILURE() << "the store held by the child was taken";
    } catch (const StoreBusyError& e) {
      EXPECT_NE(std::string(e.what()).find("process " + std::to_string(pid)), std::string::npos)
          << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "expected StoreBusyError, got: " << e.what();
    }
    EXPECT_TRUE(fs::exists(path + "/pages"));
  }
  ::close(release[1]);  // lets the child exit
  ::close(ready[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(child_ready) << "the child could not take the store";

  StoreDir dir(path);  // free now, and wiped
  EXPECT_FALSE(fs::exists(path + "/pages"));
}

TEST(StoreDir, DestructorReleasesLockAndKeepsFiles) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  {
    StoreDir dir(path);
    touch(dir.file("pages"));
  }
  EXPECT_TRUE(fs::exists(path + "/pages")) << "files must survive for inspection";
  StoreDir again(path);
  EXPECT_FALSE(fs::exists(path + "/pages")) << "the next start must wipe them";
}

TEST(StoreDir, RemoveDeletesTheDirectory) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  {
    StoreDir dir(path);
    fs::create_directories(dir.file("sub"));
    touch(dir.file("sub/file"));
    touch(dir.file("pages"));
    dir.remove();
    EXPECT_FALSE(fs::exists(path));
    dir.remove();  // idempotent
    EXPECT_FALSE(fs::exists(path));
  }
  StoreDir again(path);
  EXPECT_TRUE(fs::is_directory(path));
}

TEST(StoreDir, ParentIsARegularFile) {
  TempDir tmp;
  touch(tmp.sub("file"));
  const std::string path = tmp.sub("file/store");
  try {
    StoreDir dir(path);
    FAIL() << "a store under a regular file was created";
  } catch (const IoError& e) {
    EXPECT_EQ(e.path(), path);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(e.error_number(), 0);
  }
}

TEST(StoreDir, UnwritableParentIsAPermissionError) {
  if (::geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions";
  TempDir tmp;
  const std::string parent = tmp.sub("ro");
  fs::create_directory(parent);
  fs::permissions(parent, fs::perms::owner_read | fs::perms::owner_exec);
  const std::string path = parent + "/store";
  try {
    StoreDir dir(path);
    FAIL() << "a store in a read-only directory was created";
  } catch (const StorePermissionError& e) {
    EXPECT_EQ(e.error_number(), EACCES);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  fs::permissions(parent, fs::perms::owner_all);
}

}  // namespace
}  // namespace statepager
