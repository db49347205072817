from onnxruntime.capi import onnxruntime_pybind11_state as C
import onnx
def dv(a):
    b=a._default_value
    if not b: return None
    ap=onnx.AttributeProto(); ap.ParseFromString(b)
    return onnx.helper.get_attribute_value(ap)
for s in C.get_all_operator_schema():
    if s.domain=='com.microsoft' and s.name in ('MoE','QMoE'):
        print('='*30, s.name, 'since', s.since_version)
        print(s.doc)
        print('--inputs')
        for k,i in enumerate(s.inputs): print(' ', k, i.name, '|', i.typeStr, '|', i.option, '|', i.description)
        print('--outputs')
        for k,i in enumerate(s.outputs): print(' ', k, i.name, '|', i.typeStr, '|', i.option, '|', i.description)
        print('--attributes')
        for n,a in s.attributes.items():
            print(' ', n, '| type', a.type, '| required', a.required, '| default', dv(a), '|', a.description)
        print('--type constraints')
        for t in s.type_constraints: print(' ', t.type_param_str, t.allowed_type_strs, t.description)
