// Greedy image-text generation from an hf-layout image-text export with transformers.js 4, as a user calls it:
// AutoProcessor on an image file and a prompt naming the image, AutoModelForImageTextToText, generate.
//   node image_text_generate.mjs MODEL_DIR DTYPE REQUEST.json [REQUEST.json ...]
// A request: {"prompt": "...", "image": "/path.png" or null (text only), "max_new_tokens": N}, or a batch of prompts
// {"prompts": ["...", ...], "images": [["/path.png", ...], ...] (each prompt's images), "max_new_tokens": N}
// (Idefics3Processor takes a batch: its prompts must tokenize to one length, it does not pad them).
// Prints per request, one line each, {"input_ids": [[...]], "pixel_values": {"dims", "data"} or null,
// "pixel_attention_mask": {"dims", "data"} or null (Idefics3's), "image_grid_thw": [[t, h, w], ...] or null (Qwen's
// processors), "sequences": [[...]]}: what the processor computed (so the caller can drive transformers with the same
// inputs) and what generate gave, from one loaded model.
import { readFileSync } from "node:fs";
import path from "node:path";
import { AutoModelForImageTextToText, AutoProcessor, RawImage, env } from "@huggingface/transformers";

const [modelDir, dtype, ...requestPaths] = process.argv.slice(2);
env.allowRemoteModels = false;
env.localModelPath = path.dirname(path.resolve(modelDir)) + "/";
const name = path.basename(path.resolve(modelDir));
const processor = await AutoProcessor.from_pretrained(name);
const model = await AutoModelForImageTextToText.from_pretrained(name, dtype === "auto" ? {} : { dtype });

for (const requestPath of requestPaths) {
  const request = JSON.parse(readFileSync(requestPath, "utf8"));
  let inputs;
  if (request.prompts) {
    const images = await Promise.all(request.images.map((row) => Promise.all(row.map((p) => RawImage.read(p)))));
    inputs = await processor(request.prompts, images);
  } else if (request.image) {
    const image = await RawImage.read(request.image);
    // LlavaProcessor and PixtralProcessor take (images, text); Gemma3Processor and Qwen3VLProcessor (text, images)
    inputs = ["LlavaProcessor", "PixtralProcessor"].includes(processor.constructor.name)
      ? await processor(image, request.prompt)
      : await processor(request.prompt, image);
  } else {
    inputs = processor.tokenizer(request.prompt);
  }
  const output = await model.generate({
    ...inputs,
    max_new_tokens: request.max_new_tokens,
    min_new_tokens: request.max_new_tokens,
    do_sample: false,
  });
  const [rows, length] = output.dims;
  const flat = Array.from(output.data, Number);
  const pixels = inputs.pixel_values;
  const mask = inputs.pixel_attention_mask;
  console.log(JSON.stringify({
    input_ids: inputs.input_ids.tolist().map((row) => row.map(Number)),
    pixel_values: pixels ? { dims: pixels.dims, data: Array.from(pixels.data) } : null,
    pixel_attention_mask: mask ? { dims: mask.dims, data: Array.from(mask.data, Number) } : null,
    image_grid_thw: inputs.image_grid_thw ? inputs.image_grid_thw.tolist().map((row) => row.map(Number)) : null,
    sequences: Array.from({ length: rows }, (_, r) => flat.slice(r * length, (r + 1) * length)),
  }));
}
