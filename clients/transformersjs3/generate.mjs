// Greedy generation from an hf-layout export with transformers.js 3.x (onnxruntime-node 1.21), as a user would call it:
//   node generate.mjs MODEL_DIR DTYPE REQUEST.json [REQUEST.json ...]
// The same command as ../transformersjs/generate.mjs; only the transformers.js it imports (this folder's) differs.
import * as transformers from "@huggingface/transformers";
import { generateFromArgs } from "../transformersjs/greedy.mjs";

await generateFromArgs(transformers, process.argv.slice(2));
