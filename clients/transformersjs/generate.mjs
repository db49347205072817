// Greedy generation from an hf-layout export with transformers.js, as a user would call it:
//   node generate.mjs MODEL_DIR DTYPE REQUEST.json [REQUEST.json ...]
// REQUEST.json: {"input_ids": [[...], ...], "attention_mask": [[...], ...], "max_new_tokens": N}
// (rows left-padded as transformers' tokenizer pads for generation). Prints {"sequences": [[...], ...]}
// per request, one line each, from one loaded model.
import { readFileSync } from "node:fs";
import path from "node:path";
import { AutoModelForCausalLM, Tensor, env } from "@huggingface/transformers";

const [modelDir, dtype, ...requestPaths] = process.argv.slice(2);
env.allowRemoteModels = false;
env.localModelPath = path.dirname(path.resolve(modelDir)) + "/";
const model = await AutoModelForCausalLM.from_pretrained(path.basename(path.resolve(modelDir)), { dtype });
for (const requestPath of requestPaths) {
  const request = JSON.parse(readFileSync(requestPath, "utf8"));
  const rows = request.input_ids.length, width = request.input_ids[0].length;
  const int64 = (matrix) => new Tensor("int64", BigInt64Array.from(matrix.flat().map(BigInt)), [rows, width]);
  const output = await model.generate({
    input_ids: int64(request.input_ids),
    attention_mask: int64(request.attention_mask),
    max_new_tokens: request.max_new_tokens,
    min_new_tokens: request.max_new_tokens,
    do_sample: false,
  });
  const [, length] = output.dims;
  const flat = Array.from(output.data, Number);
  const sequences = Array.from({ length: rows }, (_, r) => flat.slice(r * length, (r + 1) * length));
  console.log(JSON.stringify({ sequences }));
}
