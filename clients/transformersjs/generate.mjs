// Greedy generation from an hf-layout export with transformers.js 4, as a user would call it:
//   node generate.mjs MODEL_DIR DTYPE REQUEST.json [REQUEST.json ...]
// Prints {"sequences": [[...], ...]} per request, one line each, from one loaded model (greedy.mjs).
import * as transformers from "@huggingface/transformers";
import { generateFromArgs } from "./greedy.mjs";

await generateFromArgs(transformers, process.argv.slice(2));
