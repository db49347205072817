// Greedy generation with whichever transformers.js the caller imported (its exports passed in), shared by
// generate.mjs (4.x under Node), web/generate.js (4.x in a browser) and ../transformersjs3/generate.mjs (3.x).
// A request: {"input_ids": [[...], ...], "attention_mask": [[...], ...], "max_new_tokens": N}, rows
// left-padded as transformers' tokenizer pads for generation.

// The batch's sequences (prompt + new tokens, one array per row) from one greedy generate call.
export async function greedy(model, Tensor, request) {
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
  return Array.from({ length: rows }, (_, r) => flat.slice(r * length, (r + 1) * length));
}

// The Node command line: MODEL_DIR DTYPE REQUEST.json [REQUEST.json ...]. Loads the model once from
// the local folder (never the hub) and prints {"sequences": [[...], ...]} per request, one line each.
export async function generateFromArgs({ AutoModelForCausalLM, Tensor, env }, [modelDir, dtype, ...requestPaths]) {
  const { readFileSync } = await import("node:fs");
  const path = (await import("node:path")).default;
  env.allowRemoteModels = false;
  env.localModelPath = path.dirname(path.resolve(modelDir)) + "/";
  const model = await AutoModelForCausalLM.from_pretrained(path.basename(path.resolve(modelDir)), { dtype });
  for (const requestPath of requestPaths) {
    const sequences = await greedy(model, Tensor, JSON.parse(readFileSync(requestPath, "utf8")));
    console.log(JSON.stringify({ sequences }));
  }
}
