// Finding a model file (src/model/model_files.hpp) in a scratch tree: a table, two models/
// folders and scripts the test writes. A path is itself; a known name is its file (the right
// size only) or is fetched by the fetch script; a wrong name lists the known ones; without a
// flag $TREEATTN_MODEL, the default model, then the find script; a bad table names its line.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "model/model_files.hpp"

namespace treeattn {
namespace {

namespace fs = std::filesystem;

class ModelFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("treeattn-model-files-" + std::to_string(getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(root_ / "a");
    fs::create_directories(root_ / "b");
    write("models.txt",
          "# name file bytes sha256\n"
          "model small small.gguf 5 0000\n"
          "part small-1 x 1 0000\n"
          "model big big.gguf 7 0000   # trailing comment\n");
    search_.table = (root_ / "models.txt").string();
    search_.dirs = {(root_ / "a").string(), (root_ / "b").string()};
    search_.fetch_script = (root_ / "fetch.sh").string();
    search_.find_script = (root_ / "find.sh").string();
  }
  void TearDown() override { fs::remove_all(root_); }

  void write(const std::string& rel, const std::string& text) {
    std::ofstream(root_ / rel) << text;
  }
  void script(const std::string& rel, const std::string& body) {
    write(rel, "#!/bin/sh\n" + body);
    chmod((root_ / rel).c_str(), 0755);
  }
  std::string path(const std::string& rel) const { return (root_ / rel).string(); }

  fs::path root_;
  model::ModelSearch search_;
};

TEST_F(ModelFiles, TableRows) {
  auto models = model::known_models(search_.table);
  ASSERT_TRUE(models.is_ok()) << models.status().to_string();
  ASSERT_EQ(models->size(), 2u);
  EXPECT_EQ((*models)[1].name, "big");
  EXPECT_EQ((*models)[1].file, "big.gguf");
  EXPECT_EQ((*models)[1].bytes, 7u);
  EXPECT_EQ(model::known_model_names(*models), "small, big");
  EXPECT_EQ((*models)[0].matmul, "");
  // The optional sixth column: matmul=MODE, a default for that file only (its name and size).
  write("models.txt", "model small small.gguf 5 0000 matmul=int8-ffn\nmodel big big.gguf 7 0000\n");
  models = model::known_models(search_.table);
  ASSERT_TRUE(models.is_ok()) << models.status().to_string();
  EXPECT_EQ((*models)[0].matmul, "int8-ffn");
  write("a/small.gguf", "12345");
  write("b/small.gguf", "123456");  // another file under the name: not the known model
  write("a/big.gguf", "1234567");
  EXPECT_EQ(model::known_model_matmul(path("a/small.gguf"), *models), "int8-ffn");
  EXPECT_EQ(model::known_model_matmul(path("b/small.gguf"), *models), "");
  EXPECT_EQ(model::known_model_matmul(path("a/big.gguf"), *models), "");
  EXPECT_EQ(model::known_model_matmul(path("a/none.gguf"), *models), "");
  for (const char* col : {"matmul=fast", "mode=int8", "int8"}) {
    write("models.txt", std::string("model small small.gguf 5 0000 ") + col + "\n");
    auto wrong = model::known_models(search_.table);
    ASSERT_FALSE(wrong.is_ok()) << col;
    EXPECT_NE(wrong.status().message().find("line 1: '" + std::string(col) +
                                            "': the optional last column is matmul="),
              std::string::npos)
        << wrong.status().message();
  }
  write("models.txt", "model small small.gguf 5 0000\nmodel broken f.gguf 12x 0000\n");
  auto bad = model::known_models(search_.table);
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("line 2"), std::string::npos);
  write("models.txt", "# nothing\n");
  EXPECT_NE(model::known_models(search_.table).status().message().find("lists no model"),
            std::string::npos);
}

TEST_F(ModelFiles, PathsAndNames) {
  write("b/big.gguf", "1234567");
  write("own.gguf", "x");
  EXPECT_EQ(*model::resolve_model_file(path("own.gguf"), search_), path("own.gguf"));
  EXPECT_EQ(*model::resolve_model_file("big", search_), path("b/big.gguf"));

  write("a/big.gguf", "123");  // the first folder's copy is partial: an error, not the second's
  auto partial = model::resolve_model_file("big", search_);
  EXPECT_EQ(partial.status().code(), Code::kInvalidArgument);
  EXPECT_NE(partial.status().message().find("has 3 bytes, not the 7 of big"), std::string::npos);

  auto unknown = model::resolve_model_file("huge", search_);
  EXPECT_NE(unknown.status().message().find("not a known model name (known: small, big;"),
            std::string::npos);
  EXPECT_NE(model::resolve_model_file(path("none.gguf"), search_)
                .status()
                .message()
                .find(": no such file"),
            std::string::npos);
  EXPECT_NE(model::resolve_model_file(path("a"), search_).status().message().find("is a directory"),
            std::string::npos);
}

TEST_F(ModelFiles, FetchesAKnownModelThatIsMissing) {
  // The fetch script gets the name and writes the file into the second folder.
  script("fetch.sh", "[ \"$1\" = small ] && printf 12345 > '" + path("b/small.gguf") + "'\n");
  auto got = model::resolve_model_file("small", search_);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(*got, path("b/small.gguf"));
  // A fetch that fails, and one that succeeds without writing the file.
  script("fetch.sh", "exit 4\n");
  EXPECT_NE(model::resolve_model_file("big", search_).status().message().find("exited with 4"),
            std::string::npos);
  script("fetch.sh", "exit 0\n");
  EXPECT_NE(
      model::resolve_model_file("big", search_).status().message().find("is in no models/ folder"),
      std::string::npos);
  fs::remove(path("fetch.sh"));
  EXPECT_NE(model::resolve_model_file("big", search_).status().message().find("is missing"),
            std::string::npos);
}

TEST_F(ModelFiles, WithoutAFlag) {
  // Nothing anywhere: the error names the default model's file and the known names.
  auto none = model::resolve_model_file("", search_);
  EXPECT_NE(none.status().message().find("no model: small.gguf"), std::string::npos);
  // The find script's answer, when it names a file.
  write("elsewhere.gguf", "m");
  script("find.sh", "echo '" + path("elsewhere.gguf") + "'\n");
  EXPECT_EQ(*model::resolve_model_file("", search_), path("elsewhere.gguf"));
  // The default model in a folder wins over the script (never fetched without a flag).
  write("a/small.gguf", "12345");
  EXPECT_EQ(*model::resolve_model_file("", search_), path("a/small.gguf"));
  // $TREEATTN_MODEL wins over both, and must be a file.
  search_.env_model = path("elsewhere.gguf");
  EXPECT_EQ(*model::resolve_model_file("", search_), path("elsewhere.gguf"));
  search_.env_model = path("missing.gguf");
  EXPECT_NE(model::resolve_model_file("", search_).status().message().find("$TREEATTN_MODEL="),
            std::string::npos);
}

}  // namespace
}  // namespace treeattn
