"""WordPiece (BERT) tokenization as llama.cpp runs it (llama-vocab.cpp ``llm_tokenizer_wpm_session``).

The text is normalized code point by code point with llama.cpp's own Unicode tables (unicode-data.cpp, not Python's
``unicodedata``): ``strip_accents`` maps each code point to the first code point of its decomposition
(``unicode_cpts_normalize_nfd``) and drops marks; ``lowercase`` is a one-to-one map (``unicode_tolower``); NUL,
U+FFFD and control characters go. Whitespace splits words; punctuation, ASCII symbols and CJK ideographs are words of
their own. Each word, with a U+2581 prefix, is cut greedily into the longest vocabulary tokens, left to right, over
its UTF-8 bytes (at most ``max_token_len`` bytes each); a word that cannot be cut whole becomes the unknown token.
"""
from __future__ import annotations

import base64
import zlib

import numpy as np

from .vocab_bpe import cpt_flags

# llama.cpp's unicode_map_lowercase (from, to - from) and unicode_ranges_nfd (start, last - start, nfd), int32 columns,
# zlib + base85
_LOWER = (
    "c-rmS3v^b+odEFgG=vZ$AchbiAcPnqQc5YHAa4;75s@NA%2JjhB2tR1T1AQ!0TCi1Ao7SIgb+eVLI@#*@Cp##Z_2BbQkF%eR9ULXvZlXm!&$ax"
    "U2AJS>T=HaJ2Us*x%1ugpF4B!H}ka%2nc9T2RhP;&fHHI9-u1^(v64c&cpQJ5qk0{y?Bh?{D3|@PG8oufsJgUfX!@SD}`)hJ3H9PE_Snrz3gK@"
    "2RO(f4s(Q~9OF1A_%$a9C>0P;nzEE9kRXByA(SdqqdH-P6G3evsYiXHh$e<u8q<WPG^05!xrf%=M>{&uiTmkFH@ee<p7f$OedtR+`ZIum3}P@t"
    "7|Jk)GlG$fVl>b3JU{0pe!)1#Gl5r`#AIG$D$|JL4c=r1GnvI~<}!~3#FIcGNi1dwsid)-3^G~4N>-6W9tCV>D}`)l2fNtAJ`Qk*UvZS<oa7Xz"
    "Im21bah?lY<U=lTnUDCGD_rFopAt~ohq9C>kRXByA(SdqqdH-P6G3evsYiXHh$e<u8q<WPwBjCG(}s3*pd+2=Oc%P+jqZ#nqb(WD%S>P*lbFmD"
    "rZSB;n9iHb;4Nk{i`l%*9Nu9r^O(;9;(3>aB(jJk7L&{pQdr6!j&O_<oa7XzIm21bah?lY<T4-g30L_~KBb6&vbrOsDMMMxQJz}}qyj-yB$!Hs"
    "P?=C}r3zK4#%)yRcEYGZI5ml&7PYBEBz39B9n_}*Q8Xl)JBgtYvD`&t?q&c38N^_QFqB~oX9Ob|#b}=61zuzfW0}kprV__=W-yc4%waC`i6?<X"
    "l1L_nRMJQ%lPt2yA(uSzS<ePGv6-!GV+Xs~%YF`Wm?IqH1SdJgY0hw#bDZY_7x{ooT;?OLaFuI(N<cYnO<BqlND#q<5K0xQQJpZtiJ&%-)T2I8"
    "L=!_Sjrk5u`7X`)9?khaEoezA?%`fq(}w$KOFP=rfsS;dGxyVl2k6R!bmJkq^DsSlgq}P~FCL>e@uB({2`nU$MI^D9WR{S^Qc_t)8p}y1gG^SC"
    "#Y(bSMGmXUWes_(C7*SyX9FAAL;;)G$}Zxox;_$ENFs|!Vll}qA%&%+vWzsAlTHSitRRb(WV4DKR+Gyb@>okg>sZeQHnNEVHnWAT6ta!&>|iIm"
    "*v%gHvXA{7;2?)M%&$1YQI2t(6a1Q!{DxEfmec%>GyE%O`8Uq-9_M+V3;dpo{DBYnkW2hKm-!=c5yobw^CmNRi<!(~Hg7YBcbLmO=Cgo!-X(#B"
    "B(jJk7L&{pQdmkV%SdB6>12?}3bI&9Hmk^CHMy)MpLGP()=w!*c>)O{m=Hp#LN%%rMmQ1FCX#y8CyHodh@~-2Xi77h(}GsqOB>qKo{n^;3tj0("
    "cY4s1Ui799ed$Mk1~8C83}y&J8OCr%Fp^P><~d&AMaD3eag1jI6Pe5urV__=W-y<45=bP8WKu{ajdU`}BAXm?$s?cjY@~oK6tbP2>}D_fImls-"
    "aEue2<P@hl!&%O8o(o*$11@oykGR5BuJLJc`_}QCC5VayQ;85N6GjcfsYwL2h~`dWXhbY`(U`kwK}%Y35BJiVHrz)S9-u1^(v63BoFDQ8KVk?^"
    "GL)wn#?uVv874A`$-KrCUS}%Pn9bYF;T`5OkNGShnI)vKlvI|H#&U94O)hK5qmXTEX9qhu!cmTKoO8U#dEVy&SNMdh{0G;Fsw;*xqA3ITCkFCk"
    "2Jz1f<|ho{Nrv(i!+4tEJi{ww*Vo6%VKup|A&<4>vySy_U?ZC-U^83TN+H|W&JK36i{0!YAl5q^r71&M%2A$M2&4i*R3w;6gix7KZlwxUsm5(o"
    "=XS!VK{z#upcb{MLnL*n#~swC0Z}w0nmdW15wYAwWA0`E1Nkw7_z6$)6i+jpXBfdqo@ER#GnR3TX95$M%oL^)$8=^eliAE+F7t^efkcu>CWTbe"
    "NGFplvdJNrJn~u3Mhe(MA=}x>ZuYXDgB<1v$2h@BPH~#|`8}6tn`G>zBc16&SGv)i9`vLaz3D?=`q7^O3}g_48NyJ8F_v+RX95$M%oL^)$8=^e"
    "liAFn-eT=a6w$;GOJkbSjOMhU75CDHwzQ`so#{eXy3w5;^rRQP=|f-o(VqbfWDtWH!cc}WoagyDFENI(jAJ|#c#YSIV>&aL%^c=3pLh~TB#C5F"
    "SV}6(NF$vLGFd?u+2oK*9{H?iBL!?`3tQR7UJi4FKT@|yY`KH_G$4wGL~|!GG$NL}Xw2O-;X5?tyENl_H0S%Ype3z}0{&~Vr4*$pLs`mEo?8f{"
    "0zp(Hm`a3DnNV(}3RS7bZB*xW!l*$wHHn}WwW&iSb*aZ4)TaSaG$fr2GFd?uE6HXRIjkm^HRQ3DeAcm^4Qyl+1#D&uTPb84+u6ZRcCnj1>}4PO"
    "Ilzc=r2>A+NPfmBo@F%u!gD;&3%tlnjNxU*@(afC3gh`D6L^)0Oky%qc%7+CBaSzi&J5lvt}j@9jN=u?^Ghc1DifK+WL{$muQQct#PJ5xd6OBu"
    "#Y|=~o41+6JIrMs^I1SV?~=em5?MqNi%Dh)DJ&(GWu&p3bTY^+t}9GkB(RV~7Lmkal379uOG#xJX)Gt53^G|k7AwhS6*;UXmo?<EmVDOHc6h0P"
    "cC@Dh9qB}8?xzb6(3J=2#zS=HVS4ZgJ$aN~JVtMRKp!5bFF&LoPtczq6;BYpryo+9GL)qp<++7GDiB0Pf~iCZl?mlms!)|`+(vb7CyW||Q<Dg4"
    "QJXqMQnxrYBz&8d`Uh)SR8&;zEBKzj#;bpEE&FfC?=DGql_*uRPH=rr|N5~#C3E=uO7<PNVJ`p1x{rNEdbGs#a>sATm;Q|O%Wz{|3&f%DAJ8si"
    "{>nNV#r!#aLiy;Dd~5kmC2KdIcm61%XmEqJ+*jhO>N|mdLyQVaV)RK#S{$?MdX%h7{jI+3W677T@;C6BzlbJZQv)Kt-uBMA>F*I3@V{$&xv1!y"
    "sMNQ7ocJ=eJN?a%*A>s=n?7H5iH}M73m@N5Zf=R|+i@j|-+{)K7+0eByoK(ecE2eq%B6UTC-m=B+@|4QktW}8#j&bzxTq-n!=j=ZhyQ0^K69w3"
    "sEmETm7YHI-^Vt{Z#Z;woV@AJu08wN_rj6BU;IAFb4~^;Sx52qMGo^m#s3TXygK$8SJo<9_<vm6SM@t7`lc_W;nzspZ;{CV=jwe;{0aBb7E="
)
_NFD = (
    "c-rmU2eeexwjj`Ri=2bx925~0kR(}h&L}wt0g)g%si1-gf`9~3P|PSfNs_35<cuUyf`F(fiVCRMvtHHh&tSmQ?tcCI|JT%Tj&-W)gnic8d+lA<"
    "p+OJ?>)6bvY-bO9In3vL$yv_vEf@KbEBwKq1Tp?0L>%H0kN6}YA&E##5|WaP<fI@qcaVm(q$52U$VetKlZC8gBRe_BNiK48CwGyTd&ozA?&UrT"
    "P>@0tr5MF|fRdD=G-W7DIVw?^DpaK!)u~M#>QayTG~gi~rZG)uN;8_%f|j(RHEn21JKEEMj&!06U3rvlJVtkV(34&~PH+0qmwxnT00SAsV1_W1"
    "CwP*Xyuo}Hu!EiKVmEu(%RcsVfP;L-Ar5ndqa5QnU+^U-ILRr_aF%m?&3V4zTfXB0-}3{P_?gRG;VQrJJAZJEKM6wm8X@8kmw3b{0SQS&Vv>-Q"
    "WF#jADM>|Y?jQ|mNk@7zkdaJeCL7tw!`<ZN9`cc&d%2GS6r>RMQ<x%@j}rtHs6=J@@+2b|$#ab2c}DXB<9Lzre86nxFqe7EX8~K;#&&kFlYInn"
    "<%R?#B^k-dNJ;9`h$gh86|L#d0M@gC-Rxm6`#8vF9N{R(_?+W>!AVYWny)y+S<dqf-|`(7_?{oQ$dCNQC4S~ISI8CLnC33>u#OGv<DNwFOi`NB"
    "jOMhUC9P;p8@6$b&-sEPiH&=j(VP~vrh1Yfs6|U!F^R2gV>{K8Y6F|uO3h^Ur#448Mx_+$0u5<GOS;mBe)MM`!+D7ryvcjaVFh_o>d%?=WfGH="
    "<fNuFWhqYuDiLHeCI}ISxWpqq2}npH5|f0aBqKQ~NJ%PEa|dZiOFGh%fsAA#Gg-(=HnNk0oa7=mcXAhbxSPD(Lq76zFZWS^f)wI@3R8rl6r(r~"
    "P=b<_qBLbFOF15-JQb)&B`Q;es#K#oHK<7~YEy^0)T2HPXh<U-;$a%ogr+p3IW1^OD_YZrwzQ)?9q33W9-%W`=*pvX<1xC^gP!!_aeC8-zVxF%"
    "0~p941~Y`AJi(JZ#W05RG|%uXBN)kZjN*AlGlmx!%Q#+SJQJA6OH5)iQ<%!jOygB%@&<467H{(o@A4kAc%KiL%^c=3kNGTMA&Xed5|;8I%UI3|"
    "R<eqZSj`&NvX1p^;A1{vBb(UFr)*&>+t|(ycCw4z>|rna*v|nD@)?IX%n^=qjL$jF7ktSHPI8LVe8m~ga*nS#&o_L_cU<6me&8ZM@)MW%nP2#o"
    "%UmJIZrqZR4CEj$g(yLJs#Bk4w4fDjXiFD*(VM>XXCQ+a$}mPTo|l=)EEez~%UQ#EHn53L*~$)fbC5%P&X=6#4CnZk@A#e{`Gw0|<qv`!Y8H8N"
    "ste@j6<%c?JJ`uC;^tDnNXnh$p#qhuMh)81p6>LZC%t%_zVu@tgBZqeo@E51c%C`TWgheSk`tWd6zBPdZ~2aUa%(%s@~J6>)D!B{kcVhYQ<~F~"
    "*0iNPo#;$gdeMje3}Psgc#S#CV*!g;!iOwpB_FYdb!=cGo7uu{_HmHI9ODwda+xb!<r={p_b^XiSl~G>($AJ^$1=}+h56tk?OtOSKNc=;koS%H"
    "jUNriw&;_7H1yr+`nx@!eeU-_<i|k_A>t61c*G|GiAYQml9G(%q#z}!NX;FjAuZ`hPX;oQiOggnE7{0S4sw!<+}z1s<l%1eau4~)&%NA70SZ!x"
    "`zcHjic*Z?JU|IbQi{@)p)BQikn&WZB9*926{=E=>eQenwWv)U>QayTG@v1kc!-B-OcR>YjOMhUC9P;p8`{#2_H>{lop^-KbfGJc(v8RHP7iw0"
    "i^u6rANtad{tRFsgBZ*ZhVleY@)W}u&eJ@@vy5OQ&oPSU8O<18U@YT!k?~AmA}=wC$xLA?FEfo-c$MkQ;5A-nCU5X2Z}B$o@GkE$i}(3}+00=s"
    "^O(;97P5%NEMX}hvW(@dU?r>gh}EoNE$dj%20rE!HnNG$e99KKvW@NRU?;oS%^vo$kNq6rAfIuF!yMr#$M~G%e8HET;3TIw%~zb^Ea&)|^L)d%"
    "e8&a8=LatGBR_G8pZSGfxy%)=@*BVN2iN#B{6~SS#y%n95SMtwCjkjbL}HSVlw_nNHEBsldNPoaOk^etS;<BYa&Z@V$VYze<vt2fkV4!~VTw?c"
    "Vie~AN>Gwgl%@=2DaV79rveqJL}jW_m1<O{1~sWgZR${$deo-@4Qa$fJWOMn(3EC0rv)u(MH|}Ej`nn*Bb|7J&UB$GkJ63D=uR&lr#F4*OF#NE"
    "fPoBRFhdy16FkXN3}ZM?^9;{2f{{GOD4u6DV|anFjN?VdGl7Y`#3Uv&g{i#EG+yCVrZa=rc%7NN!JE9r+q}cOyvHow=L2Rlhq=sSJ_}gLA{MiR"
    "rF_UTma~GDtl}e9vxc>-V?7)Am`~WqCN}daTiD7rwzGqs>|!^2*vmflbAW?<#vu-e`|@w*Eb>u+`zcHjic*Z?l%OP~C`}p4QJxA^qB2#fMs;dX"
    "lUmfK4t04YWlS)g*%U|>6BMM@9WlYGG%>*%R;IO0iHtEp>pd|+8&>fVt69TZ)`kB_bU75n5F!q7iAQ`AkdQ<qCJ9MNMsiY+l2oMT4$_d8bfhN("
    "8OcOuvXGT*WG4qX$whAN<Sz1XH+i{-eB|d|?xO$&Da8F0r5MF|fD)9X6s0LcS<3Ms<*7hLDp8p#RHHgIs7WnqQ-`|LqdpC2NFyHNVH(qfrZl5D"
    "EoezATGNKMw4*&8=tw6Xp)+0R%A-6+cY4s1UOY~3`p}nt^k)DA8N^_QFq9{FlBXEPaGvHFo@E3hd5%#$&uGT*0%IA+i;QOiFENQJOyy;!@d~dp"
    "of*8w>&)a0-sCOb<{jSUJ!bJfA26Fa%w-<)S-?UTv6v++<wKUSoE5BO6(6yhHLPVF>)F7^e8NUHv6)ZV!dAAiogM6C7rWWRUiPt{103Wt4sn<x"
    "9OW3FbDS^uk`tWd6sP%$Go0ldUvr*s_?GXu!1w&XMSkQbF7Y$J@GF<O!c~6bcmCiSe-d0V&Iu8RxWpqq2}npH5|f0aBqKQ~NJ%PEa|dZiOFGh%"
    "fsAA#Gg-(=HnNk0oa7=mcXAhbxSPD(Lq76zF9j$_A?~LzMJP%!it_*^C`l<wQ--pX<3Y+(fr?b3GF7Nbb!t$PTGXZvb*V>v8qknNJjBB^rU^}H"
    "Msr%wl2){#E$wJe2RhP;N9ar!y7DO9c#Q7!peMa}oZj@IFa7Ax00uIM!3<$2Pw*s9F^u6n%`-g92uAW8qj;XtjNt{wGL9D+&jcp&5|fzB6sGbr"
    "(|Cnfna&Je<8@~825<5fZ}SfC@*cBzpAVSL9Og2Q`7B@|i&)GOmhvIXSk4MovWkyb%^KFSj`eKdV?JRco7l{!Y+)<g*v<}ivWwm9VK4jG&jAkd"
    "8HYH`5sq?<&pFN)e8~w;a*ES@#Tm|Wj;}e-H+;)?T;O|t;37Zr6PNgzU-*^FT;VFe@jHKTjo_;BPKY?fB_8ofKtd9cm?R`68OcdON>Y)UJ4i!X"
    "(vhAFWF!-r$wF4buXsV^6(=f){OgSWx&2q)-+tYG-G2SodBsHi)jt1S?&UxGJTd<VIS$?Kez#w@U$<ZXf>(m5cu@&%aQ)}EIyUB?NN@{rqu<B9"
    "p{~Uq7mA7#eIMtB_c7P44P$O`{O#Ax=aZPfIe-7(IB%`czs|qI+T-@?_UrcR_Upg%@1EPQ{~oV6|Bu&2|7>j#@83N4p?}jc`(L$&#N4iNw_pDT"
    "eLv>^vvGU-b$jgmXS^y<i7M2fF7<erX0)RNo#;vrdeV<UQ5B;5-54uHkG)l_OvmW8JN=DVjn4lhR;Nq!KDz!ztjVL)q8qh&>?W~p^qy~w^`d#W"
    "F*c<4O=2VZ{FC?)eXolTM|1plV-p5MpV^>jY|h}D#MrjR9vl0-V)Jw3_kR^{eD0e#bKP@^&GC)7TBh?)3`L$p?7p%2z42U!xO|gq-PlKNeAa*U"
    "d~Up#8=psPpStmSw|f4uG4?rxe{95X2MJl>eoOm!78AT*CQcToGL6@Hhxfz#Mn4O`U&zw%{?X4jUKiI!;}-UkHm>UtpG;&RcQlru7)5AIspw~w"
    "=u1D+QJj<%x-O=T9(#zx*X@^{2d+DRY|KVE&ha((Q777#N;ipjQ;q!83crsp|M4TSCI?v0Uh*c=rtp93NLtd7o-E`f7x^j3X5QdU=2JMa_K}YC"
    "WFbG*l0@Vr7ZcgU=4h;%RIb?+RW+IYlSSg;sER4n4jRyy7L@1ls6{M}Zck)7Z}2X&8P8oQ{SM3=1PMq)5|WXMQk0<_4^lDnfAr0Yw7*HbvEKew"
    "{JZtIDv#Wx{{B_Gag4^+ha2OqYI1C>L-(7+Th;8ps@<`%KE1Asx2oxXx3=G^#{ciu{KoXZF2>gWzlu#6cwLOGQMZ~Wx<uPGAiCdEF}I%U|5fqt"
    "_PtxhzpDTL>iEApPshgV=jofpaJ`=pt@)Fqb${x0bHdu_T(L1aKU{B1bpE(;&bWS_h&_Mod9Obv_Pg*g;dyFVbidenYHjw&cd>1`mOXOb_1CrM"
    "jp(s$gUGqJMB5v_#**;gfpVA{b41?Pia!7GIn_iav77zuB~C7LCrQZ7U6i2`Rj5wcaQ_kOguk<0E?moOccM3a=+6KKGlZvkhLJqSo6O>UW;2v0"
    "n7~99v6v++4Y#R~`poC~+=Ez$dNiOB57UHZw4fDjXh%mLp$k3fO+N-QgsRM7HglQJLKd@>WvpNot69r>K4BA|vWvYO;1EZ7m+$$3i~PtR;r~7|"
    "m30as;t-d3#3um>Nkn3jkd$O3Cj}`<MQW<Q5CoS@3|q%(hwVLzZehjuD}`|S>+++M@0lRy219k*zZm#k6|xaenbSrF!OG{X^+pB3i{rJ&;xMzK"
    "epn$su85X>)_T#g7pHlC&e_j7<C-ioE5!FXHrs3JcB>%x#^BsBLY|-3_e_F^h6h1*=iJ)boNuyv)H#25%ud%BX)rHq;QR{uCnmssu9?zzXSFG2"
    "m>f87OTHiLKBjtJuLi-@8A0%ZBKnlUI`awFct$&3^4|3ijt+t^6xq0K^#7qj@T7CJcfPIm-yk2qPSGCUw{K~k=2}OzC584Dbe;#E)R%m}S6jw7"
    "?wEFMCyRo-#`hOpr=RbKjq!ZjNAh#c^-9Xc*%tC|z&$5Vy%d@Ba`T&Ou62L!YfCcwY&UTZR48*f*T=qZtsOB6d<}X1z<E~6<$@Q3V3hr?IsaEr"
    "yFZJEPR=*a@m;lL3&TwgXWd&*-|uzYF3;p=ZLVlC>*JYzE6*EU=bHP<Cr5K9%lRwnhy3j1Rr_wzM+UfFd)Mo0|MBf23zk<rgWQg*@puqCZvxut"
    "_)FT`Q$F(8_ky<O_S|a9cY5b}i`B0CsXnq{ROCLkIN#6id5E^pbB%J^+D~3iyN4@{Be`0spJb7*MLzH9I<M$|Rb8X#M14|@t9#ZNUiKX1Z=N<R"
    "agWP=e!?*$o#%)J!UgAf&~u#DDe^3KYI8;X=67uzs*Pjy_fhV%fa9Lm&LR5VPgL;CryCcET(_CrcJrK4y2sY8*Ij-K$iqO#<adpX+Iimo`P};$"
    "_f%P)(szkG=aKfg$9Yq@|4!ll<XUx|f0pmR@(klU|4HW`<lc74%?Y-<kCTpj(DPrZ4Otz#Tf1Mj?^R>wE#Ebnu3mdiQ=My@Yo9ZIw&{a8hNy*d"
    "xlVtcCf`l<!*y~|T)!-(9SL|>?)Pc`LHmu6pKOj_qFtr6zqaewasDyJ<v#nBcdzTzf#&*QU;7;QKA-#ADu-p{yfvM8k;b0K8s}W?UQ!#6mp$ha"
    "a{LG1%iHhdRTq{Ro5y{&%ys5@c4y_VPPpG{+i4oO?-{NcUq9$VdDosrNBQf)B+s{t9FOBi>Up*&nV@|m<aL1i$s}*N^wA#jmR~M%$=w9cu$*?*"
    "pgQ%#ZKf4t8Ao|J9L~BSkv^Tsc&|Wj_Y_ax`%az*8B<O4pOkVmg%~+5$v(9sp&Inzi;??2<^KMZlhW?HpEh5p7z#2tHjn4A)ctm0nES61j%;@C"
    "R~ts|{b8nYGMf9vR5orOqP+!RUe9f>=X02@`rKR&xkg?2NEppc+h~4@de)y9XIYHfhBWRJd6wZio0-N8>K3Uj;eLNq?zTnqm#tSMhwrID#pH2*"
    "@5u9iTt4ILx24IdFJ$i@=@Un}L{0mbXS<v)jOKHQzR}`|NM6fD^Vv|p{GLJPlnQb=GMdx1qa*!i+vrGs!!`7~(UCll9uvuP33=`<&(n;T{%XR|"
    "DUqCq`{B{4k=!SFIg<a>uSVv!nt4M(WeyYx1vC86&rseusnIYL>~0wf_B|O2D%o!whvUf~U$dJ%>}4POIlw^<#f$8FgrgkeIA3ytQ=H}uXE_%="
    "=lSS4_C${h?=vlBOz<l2aDS?ppfJ_$hzVAtiCCUiq*%t7pvj(?peZX@d6QUHKPy3ny5avvStw{*FEZX%5i;fmGp&AP{O#hkqH09^&_BlFLv&<7"
    "cy5aq3Rd{8v+c3e@_wrLc6jb{?l}!2{rQUtq2OmRjz0W_{Y#5g>CFJr7K`-p*l`~2>+y{B_>CfSVU0$SvEQ6NJi$}kn>ZBo(hs-V{(=rkLcurU"
    "#qhCe<7<?lI$d~^Ur1@}G@=8~M#s}^7PEnLO(HcWz1TqP+c;7mFBoe(eRhdtw#SHt#rv7V=`^9>NAXwU8;_aD6&{z&N*4;w^R4a7#_8Q0vi*p7"
    "p|~1ILSwfapJogNAB%@tMCQAn$dEY{{3*s)=NcK)xy0cQ7|YSxw~n!#&Z?i9cg~1C#BL1b1Sct2LfsYfst;wuHG=j&dnRWn7%DFCelZ`mj;y&R"
    "z7-0tiTCFY1u<$=F4x{{zvYEP!I5^MpuP9qIOVff#2tLb6^5%jrAq22B_p+Yf1XgVS*))1)NU84N#Qs+T9+2_HuE_itx@4MW=eG`Gp$(2e(I}R"
    "N%Mz-vf}UFcM+fAG#7oIOFi3Y`+W+Oa-ZHm$qWYYSgFYT@EC~;g@RM!Wwoyc8B0gzjD+H8`%Tn$CpU=vv1Gc>=c-SKEB!~E%t>n+@v-_*!*N$_"
    "kDy_f$lTMtXebybW+#mwxZxU8QGAQ@%(4b~t9U3lDrWFQD5skHUWrifkXYCI-s0=gTD*#}r9wdx&-kiX*LvZjGNE9txP#85Q?JW)kIZ@D+TE3b"
    "j38UtP*7AXsFwGjNZCkT-^`wJq2P+|dZ_WOAJk?x*)G{DQu8x2#r`$LCm6t7?lShPm=8Lb%chI7D}{o*y(4o&eG*m;1;fP2;m@jtf;81b!C>>n"
    "80PrV_l~$+tY-db**7wej0mqG$^2jt+-W{3UON<&6DNw{b@J=_Y)W&=8}&lLaw^vk1;5)jVfn~h^ON^KlCeQ3C_*;#PWAzjIVfD)$B0$MDdod!"
    "DR~?i`E3xMn@;&GPvg)()&Z}G8wsyvzM)`+$a<hA^%&YL6uj3w6kM<!s_5QZ$eDR<3wL`z%>1#}95>VUIq?*Mxo%{eP|!h)(U&%hA?t}M6!kuD"
    "`%qAgX0{KDgUyTOI)sAB;??LJd8A_~$lXc(wmnPiCAQK34mf6!?KsvXNh&)|T&m8z*Etj{<t6(}FA^Egae2*r+0A|vY>#0Ei`Bb@;mB&vP^Mex"
    "AHOTInwL8;m)xx8>@$(IPa|<F+c`$@$3j83?%E{guVQT4=O@xxuWs!V3Ob7S_6!BBeAkYJw)ggOjP3f--*27i%KMBWxi!Jbk&(4QUb-=o&m40?"
    "jIma|V!N%_fzJIy!Dr%eidB_Aag}*!-oQ}s$e>WL#%G(E8C^?+*AWj}v&|YB3TBJz$!uLQfPznjg18Ao!8Y3;@dL-b-#;$0?$|pb6nw`d>yL}1"
    "vIZ&eTqwvamarE2j6>ly30M3MN;^q=#)N_~erHXtVeLCPe4S8m#`ee7EQ{3Y+}0~q%%Pbks_8YYY53A-i6@1EMYgAi;q}Ztd^kB2oD_@H^4^;I"
    "JvMNSojxn{YUm$pp7MSt{K3xJ?wQWk-aBW8g3Gq!y%7qMzZnW9u*z?V#&xt+yhc3hpA@8{G{L)};C}!n;;m5"
)
_tables: tuple | None = None

# unicode_cpt_flags bits (as in vocab_bpe's flag table)
_NUMBER, _LETTER, _SEPARATOR, _MARK, _PUNCT, _SYMBOL, _CONTROL = 2, 4, 8, 0x10, 0x20, 0x40, 0x80


def _columns(blob: tuple, ncol: int) -> np.ndarray:
    a = np.frombuffer(zlib.decompress(base64.b85decode("".join(blob))), "<i4").astype(np.int64)
    return a.reshape(ncol, -1)


def _load_tables() -> tuple:
    global _tables
    if _tables is None:
        lo = _columns(_LOWER, 2)
        lower = dict(zip(lo[0].tolist(), (lo[0] + lo[1]).tolist()))
        nfd = _columns(_NFD, 3)
        nfd_map = {}
        for start, span, base in zip(nfd[0].tolist(), nfd[1].tolist(), nfd[2].tolist()):
            for cp in range(start, start + span + 1):
                nfd_map[cp] = base
        _tables = lower, nfd_map
    return _tables


def lowercase_map() -> dict[int, int]:
    """llama.cpp's unicode_tolower as a dict (code points it does not lower are absent)."""
    return _load_tables()[0]


def _is_chinese(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2B73F
            or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF      # sic 0x2B920, as HF's Rust code
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def wpm_preprocess(text: str, lowercase: bool = True, strip_accents: bool = True) -> list[str]:
    """The words of ``text`` after BERT's normalization (``preprocess``)."""
    lower, nfd = _load_tables()
    flags, white = cpt_flags()
    words = [""]
    for ch in text:
        cp = ord(ch)
        if strip_accents:
            cp = nfd.get(cp, cp)
        f = int(flags[cp]) if cp < len(flags) else 1
        if cp in white:
            if words[-1]:
                words.append("")
            continue
        if cp == 0 or cp == 0xFFFD or f & _CONTROL:
            continue
        if strip_accents and f & _MARK:
            continue
        s = chr(lower.get(cp, cp)) if lowercase else chr(cp)
        if f & _PUNCT or (cp < 0x7F and f & _SYMBOL) or _is_chinese(cp):
            if words[-1]:
                words.append("")
            words[-1] = s
            words.append("")
        else:
            words[-1] += s
    if not words[-1]:
        words.pop()
    return words


def wpm_tokenize(text: str, token_to_id: dict, unk: int | None, max_token_len: int, lowercase: bool = True,
                 strip_accents: bool = True) -> list[int]:
    """``token_to_id``: bytes -> id (UTF-8 token texts)."""
    out: list[int] = []
    get = token_to_id.get
    for word in wpm_preprocess(text, lowercase, strip_accents):
        w = ("\u2581" + word).encode("utf-8", "surrogatepass")
        n = len(w)
        start = len(out)
        i = 0
        while i < n:
            for j in range(min(n, i + max_token_len + 1), i, -1):
                t = get(w[i:j])
                if t is not None:
                    out.append(t)
                    i = j
                    break
            else:                         # no token starts here: the whole word is unknown
                del out[start:]
                break
        if len(out) == start:
            out.append(unk)
    return out
