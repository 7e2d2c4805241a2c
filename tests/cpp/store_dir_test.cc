// StoreDir: what it takes, what it refuses (untouched), what it deletes.
#include "backing/store_dir.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "backing/errors.h"
#include "backing/uring_file.h"

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

// Every entry below `root` (links not followed) with its contents (files), its target
// (links) or "/" (directories): what a refused StoreDir must leave exactly as it was.
std::map<std::string, std::string> snapshot(const std::string& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    const std::string rel = fs::relative(e.path(), root);
    if (e.is_symlink()) {
      out[rel] = "-> " + fs::read_symlink(e.path()).string();
    } else if (e.is_directory()) {
      out[rel] = "/";
    } else {
      out[rel] = slurp(e.path());
    }
  }
  return out;
}

// A store statepager left: made by a StoreDir that was never removed.
void leave_store(const std::string& path) { StoreDir dir(path); }

// A store file of `dir`'s store `name`, created and recorded as the Pager does.
std::unique_ptr<UringFile> store_file(StoreDir& dir, const std::string& name = "") {
  auto file = std::make_unique<UringFile>(dir.store_file(name), UringFile::Options{4, true, true});
  dir.adopt(*file);
  return file;
}

// A store statepager left with its default store and the store "opt0" in it.
void leave_store_with_files(const std::string& path) {
  StoreDir dir(path);
  store_file(dir);
  store_file(dir, "opt0");
}

std::vector<std::string> entries(const std::string& path) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(path)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

// Runs `make` and expects a UsageError whose message names every one of `names`.
template <typename F>
void expect_refused(F make, const std::vector<std::string>& names) {
  try {
    make();
    ADD_FAILURE() << "not refused";
  } catch (const UsageError& e) {
    for (const std::string& name : names) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
}

TEST(StoreDir, CreatesParentsMarksAndLocks) {
  TempDir tmp;
  const std::string path = tmp.sub("a/b/store");
  StoreDir dir(path);
  EXPECT_TRUE(fs::is_directory(path));
  EXPECT_EQ(dir.path(), path);
  const std::string marker = slurp(path + "/" + StoreDir::kMarker);
  EXPECT_EQ(marker.rfind("statepager-store 2\nid ", 0), 0u) << marker;
  EXPECT_NE(marker.find("\npid " + std::to_string(::getpid()) + "\n"), std::string::npos);
  EXPECT_NE(marker.find("\ndirectory created\n"), std::string::npos) << marker;
  EXPECT_EQ(slurp(path + "/.lock"), std::to_string(::getpid()) + "\n");
  const UringFile::Location file = dir.store_file("");
  EXPECT_EQ(file.dir, path);
  EXPECT_EQ(file.name, "state.bin");
}

TEST(StoreDir, NonEmptyDirectoryIsRefusedUntouched) {
  TempDir tmp;
  const std::string path = tmp.sub("project");
  fs::create_directories(path + "/src");
  touch(path + "/src/main.cc", "int main() {}");
  touch(path + "/README", "mine");
  touch(path + "/state.bin", "not a store file");
  touch(path + "/.lock", "someone else's lock");
  const auto before = snapshot(path);
  expect_refused([&] { StoreDir dir(path); }, {path, "not empty", "choose a new or empty"});
  EXPECT_EQ(snapshot(path), before);
}

TEST(StoreDir, EmptyDirectoryGivenStaysEmptyAfterRemove) {
  TempDir tmp;
  const std::string path = tmp.sub("given");
  fs::create_directory(path);
  StoreDir dir(path);
  auto file = store_file(dir);
  auto sub = store_file(dir, "opt0");
  EXPECT_TRUE(fs::exists(path + "/opt0/state.bin"));
  dir.remove();
  ASSERT_TRUE(fs::is_directory(path)) << "a directory the user gave was deleted";
  EXPECT_TRUE(fs::is_empty(path));
}

TEST(StoreDir, GivenDirectoryStaysAlsoWhenItHeldALeftoverStore) {
  TempDir tmp;
  const std::string path = tmp.sub("given");
  fs::create_directory(path);
  leave_store(path);
  StoreDir again(path);
  again.remove();
  ASSERT_TRUE(fs::is_directory(path));
  EXPECT_TRUE(fs::is_empty(path));
}

TEST(StoreDir, CreatedDirectoryIsRemovedWithEverythingItMade) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  StoreDir dir(path);
  store_file(dir);
  store_file(dir, "0-dense");
  dir.remove();
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(fs::exists(tmp.sub(""))) << "the parent must stay";
  dir.remove();  // idempotent
}

TEST(StoreDir, EntriesAddedByOthersSurviveRemove) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  StoreDir dir(path);
  auto sub = store_file(dir, "opt0");
  touch(path + "/notes.txt", "keep me");
  touch(path + "/opt0/notes.txt", "keep me too");
  dir.remove();
  EXPECT_EQ(slurp(path + "/notes.txt"), "keep me");
  EXPECT_EQ(slurp(path + "/opt0/notes.txt"), "keep me too");
  EXPECT_FALSE(fs::exists(path + "/opt0/state.bin"));
  EXPECT_FALSE(fs::exists(path + "/" + StoreDir::kMarker));
  EXPECT_FALSE(fs::exists(path + "/.lock"));
}

TEST(StoreDir, RelativePathThenChdirRemovesOnlyItsOwn) {
  TempDir tmp;
  fs::create_directories(tmp.sub("here"));
  fs::create_directories(tmp.sub("there/store/opt0"));
  // Names a store would use, in the other folder: none of them may be touched.
  touch(tmp.sub("there/store/state.bin"), "other");
  touch(tmp.sub("there/store/opt0/state.bin"), "other");
  touch(tmp.sub("there/store/.lock"), "other");
  const auto there = snapshot(tmp.sub("there"));
  const fs::path cwd = fs::current_path();
  fs::current_path(tmp.sub("here"));
  {
    StoreDir dir("store");
    auto sub = store_file(dir, "opt0");
    EXPECT_EQ(dir.path(), tmp.sub("here/store"));
    fs::current_path(tmp.sub("there"));
    dir.remove();
  }
  fs::current_path(cwd);
  EXPECT_FALSE(fs::exists(tmp.sub("here/store")));
  EXPECT_EQ(snapshot(tmp.sub("there")), there);
}

TEST(StoreDir, SymlinkAsTheStoreIsRefused) {
  TempDir tmp;
  fs::create_directories(tmp.sub("target"));
  touch(tmp.sub("target/file"), "mine");
  fs::create_directory_symlink(tmp.sub("target"), tmp.sub("link"));
  fs::create_directories(tmp.sub("empty"));
  fs::create_directory_symlink(tmp.sub("empty"), tmp.sub("link-to-empty"));
  const auto before = snapshot(tmp.sub(""));
  expect_refused([&] { StoreDir dir(tmp.sub("link")); },
                 {tmp.sub("link"), tmp.sub("target"), "symbolic link"});
  expect_refused([&] { StoreDir dir(tmp.sub("link-to-empty/")); },
                 {tmp.sub("link-to-empty"), tmp.sub("empty")});
  EXPECT_EQ(snapshot(tmp.sub("")), before);
}

TEST(StoreDir, SymlinkedAncestorIsResolvedOnce) {
  TempDir tmp;
  fs::create_directories(tmp.sub("real"));
  fs::create_directory_symlink(tmp.sub("real"), tmp.sub("alias"));
  StoreDir dir(tmp.sub("alias/store"));
  EXPECT_EQ(dir.path(), tmp.sub("real/store"));
  fs::remove(tmp.sub("alias"));
  fs::create_directories(tmp.sub("alias/store"));  // the alias now names another folder
  touch(tmp.sub("alias/store/keep"), "mine");
  dir.remove();
  EXPECT_FALSE(fs::exists(tmp.sub("real/store")));
  EXPECT_EQ(slurp(tmp.sub("alias/store/keep")), "mine");
}

TEST(StoreDir, LeftoverStoreOfOursIsClearedAndReused) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  {
    StoreDir dir(path);
    store_file(dir);
    store_file(dir, "1-expert");
  }  // no remove(): as after a crash
  ASSERT_TRUE(fs::exists(path + "/1-expert/state.bin"));
  EXPECT_NE(slurp(path + "/" + StoreDir::kMarker).find("\nfile 1-expert/state.bin "),
            std::string::npos);
  StoreDir again(path);
  EXPECT_EQ(entries(path), (std::vector<std::string>{".lock", StoreDir::kMarker}));
  EXPECT_EQ(slurp(path + "/" + StoreDir::kMarker).find("\nfile "), std::string::npos)
      << "the records of the cleared store stay in the marker";
  store_file(again);  // new again
  again.remove();
  EXPECT_FALSE(fs::exists(path)) << "a store left by a crash is statepager's to remove";
}

TEST(StoreDir, LeftoverWithForeignEntriesIsRefusedUntouched) {
  TempDir tmp;
  // An entry statepager did not create, and how the refusal names it: files and folders
  // of the user's, also those named like store files and store subdirectories.
  const std::vector<std::pair<std::string, std::string>> extras = {
      {"notes.txt", "notes.txt"},     {"opt0/notes.txt", "opt0/notes.txt"},
      {".hidden", ".hidden"},         {"sub/deeper/file", "sub"},
      {"results/", "results"},        {"results/metrics.csv", "results"},
      {"state.bin.7", "state.bin.7"}, {"opt0/state.bin.5", "opt0/state.bin.5"},
      {"opt1/state.bin", "opt1"}};
  for (size_t i = 0; i < extras.size(); ++i) {
    const auto& [extra, named] = extras[i];
    const std::string path = tmp.sub("store" + std::to_string(i));
    leave_store_with_files(path);
    fs::create_directories(fs::path(path + "/" + extra).parent_path());
    if (extra.back() != '/') touch(path + "/" + extra, "mine");
    const auto before = snapshot(path);
    expect_refused([&] { StoreDir dir(path); }, {path, named, "did not create"});
    EXPECT_EQ(snapshot(path), before) << extra;
  }
}

TEST(StoreDir, PlantedLockSymlinkIsRefusedAndItsTargetUnchanged) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  leave_store(path);
  touch(tmp.sub("victim"), "precious");
  fs::remove(path + "/.lock");
  fs::create_symlink(tmp.sub("victim"), path + "/.lock");
  expect_refused([&] { StoreDir dir(path); }, {path + "/.lock", "symbolic link"});
  EXPECT_EQ(slurp(tmp.sub("victim")), "precious");
  EXPECT_TRUE(fs::is_symlink(path + "/.lock"));

  fs::remove(path + "/.lock");
  fs::create_hard_link(tmp.sub("victim"), path + "/.lock");
  expect_refused([&] { StoreDir dir(path); }, {path + "/.lock", "hard link"});
  EXPECT_EQ(slurp(tmp.sub("victim")), "precious");
}

TEST(StoreDir, PlantedStoreFileOrSubdirectorySymlinkIsRefused) {
  TempDir tmp;
  touch(tmp.sub("victim"), "precious");
  fs::create_directories(tmp.sub("victim-dir"));
  touch(tmp.sub("victim-dir/state.bin"), "precious");
  const std::string a = tmp.sub("a"), b = tmp.sub("b");
  leave_store(a);
  fs::create_symlink(tmp.sub("victim"), a + "/state.bin");
  expect_refused([&] { StoreDir dir(a); }, {a, "state.bin"});
  leave_store(b);
  fs::create_directory_symlink(tmp.sub("victim-dir"), b + "/0-dense");
  expect_refused([&] { StoreDir dir(b); }, {b, "0-dense"});
  EXPECT_EQ(slurp(tmp.sub("victim")), "precious");
  EXPECT_EQ(slurp(tmp.sub("victim-dir/state.bin")), "precious");
  EXPECT_TRUE(fs::is_symlink(a + "/state.bin"));
}

TEST(StoreDir, StoreFilesAreCreatedNewNeverThroughALink) {
  TempDir tmp;
  touch(tmp.sub("victim"), "precious");
  StoreDir dir(tmp.sub("store"));
  // Planted in the live store before the store files are created.
  fs::create_symlink(tmp.sub("victim"), tmp.sub("store/state.bin"));
  EXPECT_THROW(UringFile(dir.store_file(""), UringFile::Options{4, true, true}), IoError);
  fs::create_directory_symlink(tmp.sub(""), tmp.sub("store/opt0"));
  EXPECT_THROW(dir.store_file("opt0"), IoError);
  EXPECT_EQ(slurp(tmp.sub("victim")), "precious");
  // Without O_EXCL the link is still never followed.
  EXPECT_THROW(UringFile(dir.store_file(""), UringFile::Options{4, true, false}), IoError);
  EXPECT_EQ(slurp(tmp.sub("victim")), "precious");
  dir.remove();
  EXPECT_EQ(slurp(tmp.sub("victim")), "precious");
}

TEST(StoreDir, StoreInsideAStoreIsRefused) {
  TempDir tmp;
  const std::string outer = tmp.sub("outer");
  {
    StoreDir live(outer);
    auto file = store_file(live);
    expect_refused([&] { StoreDir dir(outer + "/inner"); }, {outer + "/inner", outer});
    expect_refused([&] { StoreDir dir(outer + "/x/y/inner"); }, {outer + "/x/y/inner", outer});
    EXPECT_FALSE(fs::exists(outer + "/inner"));
    EXPECT_FALSE(fs::exists(outer + "/x"));
  }
  // Left, not removed: still a store.
  expect_refused([&] { StoreDir dir(outer + "/inner"); }, {outer + "/inner", outer});
  EXPECT_TRUE(fs::exists(outer + "/state.bin"));
}

TEST(StoreDir, ParentOfALiveStoreIsRefused) {
  TempDir tmp;
  const std::string parent = tmp.sub("runs");
  StoreDir live(parent + "/rank0");
  UringFile file(live.store_file(""), UringFile::Options{4, true, true});
  const auto before = snapshot(parent);
  expect_refused([&] { StoreDir dir(parent); }, {parent, parent + "/rank0", "statepager store"});
  expect_refused([&] { StoreDir dir(tmp.sub("")); }, {parent + "/rank0"});  // two levels up
  EXPECT_EQ(snapshot(parent), before);
}

TEST(StoreDir, ForeignMarkerIsRefused) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  fs::create_directories(path);
  touch(path + "/" + StoreDir::kMarker, "statepager-store 99\n");
  touch(path + "/state.bin", "left");
  const auto before = snapshot(path);
  expect_refused([&] { StoreDir dir(path); }, {path, "statepager-store 99", "nothing was touched"});
  EXPECT_EQ(snapshot(path), before) << "a refused StoreDir left a .lock or changed a file";
}

TEST(StoreDir, RefusedLeftoverKeepsItsLockAndMarker) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  leave_store_with_files(path);
  touch(path + "/results.csv", "mine");
  const auto before = snapshot(path);
  expect_refused([&] { StoreDir dir(path); }, {path, "results.csv"});
  EXPECT_EQ(snapshot(path), before);
}

TEST(StoreDir, RemoveSparesUserFilesNamedLikeStoreFiles) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  StoreDir dir(path);
  auto file = store_file(dir);
  auto sub = store_file(dir, "opt0");
  touch(path + "/state.bin.7", "mine");       // named like a stripe
  touch(path + "/opt0/state.bin.5", "mine");
  fs::rename(path + "/opt0/state.bin", tmp.sub("moved"));  // and one put in a file's place
  touch(path + "/opt0/state.bin", "mine too");
  dir.remove();
  EXPECT_EQ(slurp(path + "/state.bin.7"), "mine");
  EXPECT_EQ(slurp(path + "/opt0/state.bin.5"), "mine");
  EXPECT_EQ(slurp(path + "/opt0/state.bin"), "mine too");
  EXPECT_FALSE(fs::exists(path + "/state.bin"));
  EXPECT_EQ(entries(path), (std::vector<std::string>{"opt0", "state.bin.7"}));
}

TEST(StoreDir, DirectoryPutInItsPlaceIsNotRemoved) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  StoreDir dir(path);
  store_file(dir);
  fs::rename(path, tmp.sub("moved"));
  fs::create_directory(path);  // the user's, empty
  dir.remove();
  EXPECT_TRUE(fs::is_directory(path)) << "remove() deleted a directory it did not create";
  EXPECT_TRUE(fs::is_empty(tmp.sub("moved"))) << "its own entries stay where it moved";
}

TEST(StoreDir, AMarkerThatCannotBeWrittenIsRemoved) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  fs::create_directory(path);
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  // A file-size limit of 1 byte stands in for a full disk (SIGXFSZ ignored: EFBIG).
  const auto previous = std::signal(SIGXFSZ, SIG_IGN);
  rlimit one = old;
  one.rlim_cur = 1;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &one), 0);
  bool threw = false;
  try {
    StoreDir dir(path);
  } catch (const IoError&) {
    threw = true;
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  EXPECT_TRUE(threw);
  EXPECT_TRUE(fs::is_empty(path)) << "a failed StoreDir left a marker or a lock";
  StoreDir dir(path);  // the directory is usable again
}

TEST(StoreDir, ForkedChildCannotRemoveAndLeavesTheLockHeld) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  auto dir = std::make_unique<StoreDir>(path);
  auto file = store_file(*dir);
  const auto before = snapshot(path);
  const pid_t pid = ::fork();
  if (pid == 0) {
    int code = 0;
    try {
      dir->remove();
      code = 1;
    } catch (const UsageError& e) {
      if (std::string(e.what()).find("forked child") == std::string::npos) code = 2;
    } catch (...) {
      code = 3;
    }
    try {
      dir->store_file("opt0");
      code = 4;
    } catch (const UsageError&) {
    }
    file.reset();
    dir.reset();  // the child's copies of the descriptors, the lock's included, close
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: removed, 2: unclear error, 3: other, 4: store made";
  EXPECT_EQ(snapshot(path), before);
  EXPECT_THROW(StoreDir again(path), StoreBusyError) << "the child released the parent's lock";
  dir->remove();
  EXPECT_FALSE(fs::exists(path));
}

TEST(StoreDir, SecondInSameProcessIsBusy) {
  TempDir tmp;
  const std::string path = tmp.sub("store");
  StoreDir first(path);
  UringFile file(first.store_file(""), UringFile::Options{4, true, true});
  try {
    StoreDir second(path);
    FAIL() << "a second StoreDir on " << path << " was allowed";
  } catch (const StoreBusyError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    EXPECT_NE(what.find("process " + std::to_string(::getpid())), std::string::npos) << what;
  }
  EXPECT_TRUE(fs::exists(path + "/state.bin")) << "the refused StoreDir wiped the live store";
  EXPECT_TRUE(fs::exists(path + "/" + StoreDir::kMarker));
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
    std::unique_ptr<UringFile> file;
    try {
      dir = std::make_unique<StoreDir>(path);
      file = store_file(*dir);
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
    EXPECT_TRUE(fs::exists(path + "/state.bin"));
  }
  ::close(release[1]);  // lets the child exit
  ::close(ready[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(child_ready) << "the child could not take the store";

  StoreDir dir(path);  // free now: the child's leftover store is cleared
  EXPECT_FALSE(fs::exists(path + "/state.bin"));
}

TEST(StoreDir, StoreNamesArePlainFileNames) {
  TempDir tmp;
  StoreDir dir(tmp.sub("store"));
  for (const char* bad : {".hidden", "../escape", "a/b", ""}) {
    if (*bad == '\0') continue;  // "" is the default store
    EXPECT_THROW(dir.store_file(bad), UsageError) << bad;
  }
  EXPECT_FALSE(fs::exists(tmp.sub("escape")));
  EXPECT_EQ(dir.store_file("0-dense").dir, tmp.sub("store/0-dense"));
  EXPECT_EQ(dir.store_file("0-dense").dir, tmp.sub("store/0-dense"));  // once made, reused
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
