// Greedy generation from an hf-layout export with transformers.js in a browser, as a web page would call it.
// Query: model=URL path of the model folder (config.json, onnx/, tokenizer files), request=URL of a JSON
// {"input_ids": [[...], ...], "attention_mask": [[...], ...], "max_new_tokens": N} (rows left-padded).
// Publishes {"sequences": [[...], ...], "ort_web": VERSION} or {"error": TEXT} as window.result and in
// #output (an element with id="result" would itself be window.result until then).
//
// Everything comes from this origin: transformers.js's self-contained browser bundle (onnxruntime-web's JS
// inside it) and onnxruntime-web's WASM build (.wasm + its .mjs loader) from the client's node_modules, pinned by
// package-lock.json to the version the bundle was built against (the page reports it; the test checks it).
import { AutoModelForCausalLM, Tensor, env } from "../node_modules/@huggingface/transformers/dist/transformers.js";
import { greedy } from "../greedy.mjs";

const ORT_DIST = new URL("../node_modules/onnxruntime-web/dist/", import.meta.url);

function publish(result) {
  window.result = result;
  document.getElementById("output").textContent = JSON.stringify(result);
  document.getElementById("status").textContent = "error" in result ? "failed" : "done";
}

async function generate() {
  const params = new URLSearchParams(location.search);
  const modelPath = new URL(params.get("model"), location.href).pathname.replace(/\/+$/, "");
  const request = await (await fetch(params.get("request"))).json();

  env.allowRemoteModels = false;  // never the Hugging Face hub: the model is on this server
  env.allowLocalModels = true;
  env.localModelPath = modelPath.slice(0, modelPath.lastIndexOf("/") + 1);
  env.useBrowserCache = false;  // each load fetches the files over HTTP, never a copy from the Cache API
  const wasm = env.backends.onnx.wasm;
  // The asyncify build is the one the bundle loads by default (from a CDN, were wasmPaths unset).
  wasm.wasmPaths = {
    mjs: new URL("ort-wasm-simd-threaded.asyncify.mjs", ORT_DIST).href,
    wasm: new URL("ort-wasm-simd-threaded.asyncify.wasm", ORT_DIST).href,
  };
  wasm.numThreads = 1;  // more threads need SharedArrayBuffer, i.e. a cross-origin-isolated page

  const model = await AutoModelForCausalLM.from_pretrained(modelPath.slice(modelPath.lastIndexOf("/") + 1),
                                                           { dtype: "fp32", device: "wasm" });
  const sequences = await greedy(model, Tensor, request);
  return { sequences, ort_web: env.backends.onnx.versions.web };
}

generate().then(publish, (error) => publish({ error: `${error?.stack ?? error}` }));
